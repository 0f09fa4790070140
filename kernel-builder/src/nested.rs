//! The nested cargo build of the kernel crate for nvptx64: announced when
//! it compiles `core` for the GPU, run, and its failure explained.

use crate::command::{artifact_dir, nested_command};
use crate::config::Knobs;
use crate::hint::MissingComponent;
use crate::notice::{first_build_line, notice};
use crate::{env::Env, error::Error, error::Result};
use std::path::{Path, PathBuf};

/// Builds the kernel crate at `krate` (library `lib`) with `knobs` in
/// `target_dir`; returns the directory holding its artifacts (the PTX and
/// the dep-info). With `announce`, a first build says so first.
pub(crate) fn build(
    env: &Env,
    krate: &Path,
    target_dir: &Path,
    knobs: &Knobs,
    lib: &str,
    patches: &[(String, PathBuf)],
    announce: bool,
) -> Result<PathBuf> {
    let rustflags = knobs.encoded_rustflags();
    // A first build (or a new toolchain or flag set) compiles `core` for
    // the GPU: say so before it starts, since cargo shows nothing but
    // its progress bar meanwhile.
    let stamp = target_dir.join("kernel-builder.stamp");
    let stamp_text = format!("{rustflags}\n{}", rustc_version(env));
    if announce && std::fs::read_to_string(&stamp).ok().as_deref() != Some(stamp_text.as_str()) {
        notice(&first_build_line(lib, &knobs.arch));
    }

    let cargo = env.var("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = nested_command(
        &cargo,
        krate,
        target_dir,
        &rustflags,
        env.keys().map(String::from),
    );
    for (name, dir) in patches {
        // A TOML string: the path's backslashes and quotes escaped.
        let dir = dir
            .display()
            .to_string()
            .replace('\\', "\\\\")
            .replace('"', "\\\"");
        cmd.arg("--config")
            .arg(format!("patch.crates-io.{name}.path=\"{dir}\""));
    }
    let output = cmd.output().map_err(|source| Error::Spawn {
        cargo: cargo.clone(),
        source,
    })?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        return Err(Error::NestedBuild {
            krate: krate.to_path_buf(),
            status: output.status,
            missing: MissingComponent::diagnose(&stderr),
            stderr,
        });
    }
    // Best effort: without it the next build only announces itself again.
    let _ = std::fs::write(&stamp, &stamp_text);
    Ok(artifact_dir(target_dir))
}

/// `rustc -V` of the toolchain building the build script (the nested build
/// uses the same one), for the first-build stamp.
fn rustc_version(env: &Env) -> String {
    let rustc = env.var("RUSTC").unwrap_or_else(|| "rustc".into());
    std::process::Command::new(rustc)
        .arg("-V")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}
