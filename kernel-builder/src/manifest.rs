//! The kernel crate's library name, from its `Cargo.toml`: the PTX and the
//! dep-info of the nested build are named after it.

/// The library's crate name in a `Cargo.toml` text: `[lib] name`, else
/// `[package] name` with `-` as `_`. A line-based reading that covers the
/// usual `name = "..."` forms (no TOML parser in users' build graphs);
/// `None` when neither is found.
pub fn lib_name(manifest: &str) -> Option<String> {
    let mut section = String::new();
    let (mut package, mut lib) = (None, None);
    for line in manifest.lines() {
        let line = line.split('#').next().unwrap_or("").trim();
        if let Some(header) = line.strip_prefix('[') {
            section = header.trim_end_matches(']').trim().to_string();
            continue;
        }
        let Some((key, value)) = line.split_once('=') else {
            continue;
        };
        if key.trim() != "name" {
            continue;
        }
        let value = value.trim();
        let unquoted = value
            .strip_prefix('"')
            .and_then(|v| v.strip_suffix('"'))
            .or_else(|| value.strip_prefix('\'').and_then(|v| v.strip_suffix('\'')));
        let Some(name) = unquoted.filter(|n| !n.is_empty()) else {
            continue;
        };
        match section.as_str() {
            "package" => package = package.or(Some(name.to_string())),
            "lib" => lib = lib.or(Some(name.to_string())),
            _ => {}
        }
    }
    lib.or(package).map(|n| n.replace('-', "_"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn package_and_lib_names() {
        let m = "[package]\nname = \"bf16-kernels\"\nversion = \"0.1.0\"\n\n[dependencies]\nhalf = { version = \"2\" }\nname = \"x\"\n";
        assert_eq!(lib_name(m).as_deref(), Some("bf16_kernels"));
        let m = "[package]\nname='my-kernels' # a comment\n[lib]\ncrate-type = [\"rlib\"]\nname = \"kern\"\n";
        assert_eq!(lib_name(m).as_deref(), Some("kern"));
        let m = "[package]\nname = \"k\"\n[[bin]]\nname = \"tool\"\n";
        assert_eq!(lib_name(m).as_deref(), Some("k"));
        assert_eq!(lib_name("[workspace]\nmembers = []\n"), None);
        assert_eq!(lib_name("[package]\nname = \"\"\n"), None);
    }
}
