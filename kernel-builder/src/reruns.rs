//! The build script's `cargo:` directives, and the rerun triggers read from
//! the nested build's dep-info: the sources it read, their packages'
//! manifests and the lock file.

use crate::depinfo;
use crate::error::Result;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Where the `cargo:` directives go (a build script's stdout).
pub(crate) struct Directives<'a>(pub(crate) &'a mut dyn Write);

impl Directives<'_> {
    /// Prints `cargo:<line>`. A failed write to stdout is cargo's problem,
    /// not ours.
    pub(crate) fn line(&mut self, line: String) {
        let _ = writeln!(self.0, "cargo:{line}");
    }
}

/// Reruns the build script when a source the nested build read (its
/// dep-info at `dep_info`) changes, when a manifest of their packages
/// changes, and when the lock file the build resolved with changes. Returns
/// the sources and the packages (the kernel crate `krate` first).
pub(crate) fn dep_info(
    emit: &mut Directives<'_>,
    dep_info: &Path,
    krate: &Path,
) -> Result<(Vec<PathBuf>, Vec<PathBuf>)> {
    let sources = depinfo::sources(dep_info)?;
    for source in &sources {
        emit.line(format!("rerun-if-changed={}", source.display()));
    }
    let mut packages = vec![krate.to_path_buf()];
    for p in depinfo::packages(&sources) {
        if !packages.contains(&p) {
            emit.line(format!(
                "rerun-if-changed={}",
                p.join("Cargo.toml").display()
            ));
            packages.push(p);
        }
    }
    // The lock file the nested build resolved its dependencies with.
    if let Some(lock) = krate
        .ancestors()
        .map(|d| d.join("Cargo.lock"))
        .find(|l| l.is_file())
    {
        emit.line(format!("rerun-if-changed={}", lock.display()));
    }
    Ok((sources, packages))
}
