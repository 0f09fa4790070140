//! `host ptx`: show the PTX that build.rs compiled from `gpu-kernels`.

use host::ptx;
use std::path::Path;

pub fn run(out: Option<&Path>) -> host::Result<()> {
    match out {
        Some(path) => {
            std::fs::write(path, ptx::PTX)?;
            eprintln!(
                "wrote {} ({})",
                path.display(),
                super::fmt::size(ptx::PTX.len())
            );
        }
        None => print!("{}", ptx::PTX),
    }
    eprintln!("target: {}", ptx::target(ptx::PTX).unwrap_or("?"));
    eprintln!("entry points: {}", ptx::entry_points(ptx::PTX).join(", "));
    Ok(())
}
