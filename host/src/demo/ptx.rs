//! `host ptx`: show the PTX that build.rs compiled from `gpu-kernels`.

use gpufeed::ptx;
use std::path::Path;

pub fn run(out: Option<&Path>) -> gpufeed::Result<()> {
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
