//! The commit a build embeds, for results files: `git rev-parse` with a
//! `-dirty` flag that follows the build's own sources.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The workspace's own files every build reads, relative to its root.
pub const WORKSPACE_FILES: &[&str] = &["Cargo.toml", "Cargo.lock", "rust-toolchain.toml"];

/// `git rev-parse --short=12 HEAD`, with `-dirty` when a source of this build
/// differs from it; `unknown` outside a git checkout. The sources: the
/// [`WORKSPACE_FILES`] of `workspace` and each package's `Cargo.toml`,
/// `build.rs` and `src/` (untracked files there included; an edit
/// elsewhere, to a README or a test, does not count).
///
/// Prints `cargo:rerun-if-changed` lines (on stdout, for the build script
/// calling it) so that the flag follows every edit of a source it covers and
/// every move of HEAD (`HEAD` and the branch's ref), and never reruns on
/// `.git/index` (which `git add` or any other git command may rewrite). It
/// never writes to the repository (`GIT_OPTIONAL_LOCKS=0`: a plain
/// `git status` refreshes `.git/index`).
pub fn git_commit(workspace: &Path, packages: &[PathBuf]) -> String {
    git_commit_to(workspace, packages, &mut std::io::stdout().lock())
}

pub(crate) fn git_commit_to(workspace: &Path, packages: &[PathBuf], out: &mut dyn Write) -> String {
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .current_dir(workspace)
            .env("GIT_OPTIONAL_LOCKS", "0")
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let Some(commit) = git(&["rev-parse", "--short=12", "HEAD"]) else {
        // Not a git checkout (a packaged source, or git missing): no
        // commit, and nothing in .git to rerun on.
        return "unknown".into();
    };
    let git_path = |name: &str| git(&["rev-parse", "--git-path", name]).map(|p| workspace.join(p));
    // Not `packed-refs`: git rewrites it for other refs (`fetch --prune`,
    // `gc`), and a commit on a packed branch writes a loose ref again.
    let mut watch = vec![git_path("HEAD"), git_path("reftable")];
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        // A branch's loose ref, or, while it is packed, the directory where a
        // commit creates it again.
        let mut path = git_path(&branch);
        while let Some(p) = path.as_ref().filter(|p| !p.exists()) {
            path = p.parent().map(Path::to_path_buf);
        }
        watch.push(path);
    }
    // rerun-if-changed on a missing path reruns every time: only existing ones.
    for path in watch.into_iter().flatten().filter(|p| p.exists()) {
        let _ = writeln!(out, "cargo:rerun-if-changed={}", path.display());
    }
    let root = workspace
        .canonicalize()
        .unwrap_or_else(|_| workspace.into());
    let mut sources: Vec<String> = WORKSPACE_FILES.iter().map(|f| f.to_string()).collect();
    for package in packages {
        let dir = package.canonicalize().unwrap_or_else(|_| package.clone());
        let Ok(rel) = dir.strip_prefix(&root) else {
            continue;
        };
        for part in ["Cargo.toml", "build.rs", "src"] {
            sources.push(rel.join(part).to_string_lossy().into_owned());
        }
    }
    sources.sort();
    sources.dedup();
    sources.retain(|s| root.join(s).exists());
    for source in &sources {
        let _ = writeln!(
            out,
            "cargo:rerun-if-changed={}",
            root.join(source).display()
        );
    }
    let mut status = vec!["status", "--porcelain", "--untracked-files=normal", "--"];
    status.extend(sources.iter().map(String::as_str));
    match git(&status) {
        Some(s) if !s.is_empty() => format!("{commit}-dirty"),
        _ => commit,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outside_a_checkout_the_commit_is_unknown_and_nothing_is_watched() {
        let dir = std::env::temp_dir().join(format!("kb-git-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // GIT_CEILING_DIRECTORIES is not needed: the temp dir is not in a repo
        // on any sane machine; if it is, the test only checks the shape.
        let mut out = Vec::new();
        let c = git_commit_to(&dir, &[], &mut out);
        if c == "unknown" {
            assert!(out.is_empty());
        } else {
            assert!(c.len() >= 12, "{c}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn in_this_checkout_the_commit_is_hex_and_sources_are_watched() {
        let crate_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let Some(workspace) = crate_dir.parent() else {
            return;
        };
        let mut out = Vec::new();
        let c = git_commit_to(workspace, std::slice::from_ref(&crate_dir), &mut out);
        if c == "unknown" {
            return; // a packaged source, or no git
        }
        let hex = c.trim_end_matches("-dirty");
        assert_eq!(hex.len(), 12, "{c}");
        assert!(hex.bytes().all(|b| b.is_ascii_hexdigit()), "{c}");
        let out = String::from_utf8(out).unwrap();
        assert!(out.contains("kernel-builder/src\n"), "{out}");
        assert!(!out.contains(".git/index"), "{out}");
    }
}
