//! The sources a nested build read, from cargo's dep-info file.

use crate::error::Error;
use std::path::{Path, PathBuf};

/// Parses the first rule of a dep-info text, `<artifact>: <source> <source>...`:
/// the sources, with `\ ` read as a space in a path. Cargo lists the local
/// packages' files there (the kernel crate and its path dependencies), not
/// `core`'s nor registry crates'.
pub fn parse(text: &str) -> Vec<PathBuf> {
    let line = text.lines().next().unwrap_or("");
    let mut paths = Vec::new();
    let mut current = String::new();
    let mut chars = line.chars().peekable();
    let mut in_sources = false;
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&' ') => {
                current.push(' ');
                chars.next();
            }
            ':' if !in_sources && matches!(chars.peek(), Some(' ') | None) => {
                in_sources = true;
                current.clear();
            }
            ' ' => {
                if in_sources && !current.is_empty() {
                    paths.push(PathBuf::from(std::mem::take(&mut current)));
                }
                current.clear();
            }
            c => current.push(c),
        }
    }
    if in_sources && !current.is_empty() {
        paths.push(PathBuf::from(current));
    }
    paths
}

/// The existing sources listed in the dep-info file at `path` (a missing path
/// named with `rerun-if-changed` would rerun the build script every time).
pub fn sources(path: &Path) -> Result<Vec<PathBuf>, Error> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::DepInfo {
        path: path.into(),
        source,
    })?;
    let mut paths = parse(&text);
    paths.retain(|p| p.exists());
    Ok(paths)
}

/// The package directories (the nearest ancestor holding a `Cargo.toml`) of
/// `sources`, each once, in first-seen order.
pub fn packages(sources: &[PathBuf]) -> Vec<PathBuf> {
    let mut packages: Vec<PathBuf> = Vec::new();
    for source in sources {
        let package = source
            .ancestors()
            .skip(1)
            .find(|d| d.join("Cargo.toml").is_file());
        if let Some(dir) = package.filter(|d| !packages.iter().any(|p| p == d)) {
            packages.push(dir.to_path_buf());
        }
    }
    packages
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_sources_with_escaped_spaces() {
        let text = "/t/release/bf16_kernels.ptx: /w/k/src/lib.rs /w/my\\ dir/src/a.rs /w/abi/src/lib.rs\n\n\
                    /t/release/libbf16_kernels.rlib: /w/k/src/lib.rs\n";
        assert_eq!(
            parse(text),
            [
                PathBuf::from("/w/k/src/lib.rs"),
                PathBuf::from("/w/my dir/src/a.rs"),
                PathBuf::from("/w/abi/src/lib.rs"),
            ]
        );
        assert!(parse("").is_empty());
        assert!(parse("/t/x.ptx:").is_empty());
        assert_eq!(parse("/t/x.ptx: /a.rs"), [PathBuf::from("/a.rs")]);
    }

    #[test]
    fn missing_files_are_left_out_and_packages_found() {
        let dir = std::env::temp_dir().join(format!("kb-depinfo-{}", std::process::id()));
        let src = dir.join("pkg/src");
        std::fs::create_dir_all(&src).unwrap();
        std::fs::write(dir.join("pkg/Cargo.toml"), "[package]\nname = \"pkg\"\n").unwrap();
        std::fs::write(src.join("lib.rs"), "").unwrap();
        std::fs::write(src.join("m.rs"), "").unwrap();
        let d = dir.join("x.d");
        std::fs::write(
            &d,
            format!(
                "x.ptx: {} {} {}\n",
                src.join("lib.rs").display(),
                dir.join("gone.rs").display(),
                src.join("m.rs").display()
            ),
        )
        .unwrap();
        let found = sources(&d).unwrap();
        assert_eq!(found, [src.join("lib.rs"), src.join("m.rs")]);
        assert_eq!(packages(&found), [dir.join("pkg")]);
        let e = sources(&dir.join("none.d")).unwrap_err();
        assert!(matches!(e, Error::DepInfo { .. }));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
