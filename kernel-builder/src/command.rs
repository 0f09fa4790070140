//! The nested cargo invocation that builds a kernel crate for
//! `nvptx64-nvidia-cuda`, and where its target directory goes.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The target triple of the kernel build.
pub const TARGET: &str = "nvptx64-nvidia-cuda";

/// Whether a variable of the build script's environment describes the outer
/// (host) build, so the nested build must not inherit it: cargo's `CARGO_*`
/// (its own configuration through the environment, the outer package's
/// metadata, `CARGO_ENCODED_RUSTFLAGS`, `CARGO_MAKEFLAGS`...), `RUSTC*`
/// (`RUSTC`, `RUSTC_WRAPPER`, `RUSTC_WORKSPACE_WRAPPER`, `RUSTC_LINKER`...),
/// `RUSTFLAGS`, `RUSTDOCFLAGS`, the `DEP_*` metadata of the outer package's
/// dependencies, and `OUT_DIR` (a kernel crate without a build script of its
/// own would otherwise see the caller's). `RUSTUP_TOOLCHAIN` stays, so the
/// nested cargo uses the toolchain the outer build runs on (the one
/// `rust-toolchain.toml` pinned); so do the user's settings of where cargo
/// lives and how it reaches registries ([`USER_CARGO_SETTINGS`]), which
/// describe the machine rather than the outer build.
pub fn is_outer_build_var(key: &str) -> bool {
    let user_setting = USER_CARGO_SETTINGS
        .iter()
        .any(|p| key == p.trim_end_matches('_') || key.starts_with(p));
    (key.starts_with("CARGO_") && !user_setting)
        || key.starts_with("RUSTC")
        || key == "RUSTFLAGS"
        || key == "RUSTDOCFLAGS"
        || key.starts_with("DEP_")
        || key == "OUT_DIR"
}

/// `CARGO_*` variables (and prefixes) kept for the nested build: the cargo
/// home and the network and registry settings. Without them a nested build
/// on a machine with a custom `CARGO_HOME` or offline settings would look for
/// its dependencies somewhere else.
pub const USER_CARGO_SETTINGS: &[&str] = &[
    "CARGO_HOME",
    "CARGO_NET_",
    "CARGO_HTTP_",
    "CARGO_REGISTRIES_",
    "CARGO_REGISTRY_",
];

/// The nested build's environment settings: what it sets, on top of an
/// environment cleared of [`is_outer_build_var`] variables.
pub fn nested_env(encoded_rustflags: &str) -> Vec<(&'static str, String)> {
    vec![
        // The nvptx-only features (abi_ptx, stdarch_nvptx, core_float_math) and
        // -Zbuild-std need an unstable switch: for this nested build only.
        ("RUSTC_BOOTSTRAP", "1".into()),
        ("CARGO_ENCODED_RUSTFLAGS", encoded_rustflags.into()),
        // One fat-LTO unit: a kernel edit rebuilds in seconds (the time goes
        // to the bitcode linker otherwise) and the PTX is whole.
        ("CARGO_PROFILE_RELEASE_LTO", "fat".into()),
        ("CARGO_PROFILE_RELEASE_CODEGEN_UNITS", "1".into()),
        ("CARGO_PROFILE_RELEASE_DEBUG", "false".into()),
        ("CARGO_TERM_COLOR", "never".into()),
    ]
}

/// The nested build's arguments: the kernel crate's library as a `cdylib`
/// for nvptx64 (the "linker", llvm-bitcode-linker, writes the PTX), in
/// release, with `core` built from source.
pub fn nested_args(manifest: &Path, target_dir: &Path) -> Vec<OsString> {
    let mut args: Vec<OsString> = [
        "rustc",
        "--lib",
        "--release",
        "--crate-type",
        "cdylib",
        "--target",
        TARGET,
        "-Zbuild-std=core",
    ]
    .iter()
    .map(OsString::from)
    .collect();
    args.push("--manifest-path".into());
    args.push(manifest.into());
    args.push("--target-dir".into());
    args.push(target_dir.into());
    args
}

/// The nested cargo command: `cargo` (the outer build's, from `CARGO`), run
/// in the kernel crate's directory, with the outer build's variables among
/// `outer_keys` removed and [`nested_env`] set.
pub fn nested_command(
    cargo: &str,
    krate: &Path,
    target_dir: &Path,
    encoded_rustflags: &str,
    outer_keys: impl IntoIterator<Item = String>,
) -> Command {
    let mut cmd = Command::new(cargo);
    for key in outer_keys {
        if is_outer_build_var(&key) {
            cmd.env_remove(&key);
        }
    }
    cmd.current_dir(krate)
        .args(nested_args(&krate.join("Cargo.toml"), target_dir));
    for (key, value) in nested_env(encoded_rustflags) {
        cmd.env(key, value);
    }
    cmd
}

/// Where the PTX and the dep-info of a nested build lie.
pub fn artifact_dir(target_dir: &Path) -> PathBuf {
    target_dir.join(TARGET).join("release")
}

/// Where nested builds go by default: `<target>/nvptx-kernels` when
/// `OUT_DIR` has cargo's usual shape `<target>/<profile>/build/<pkg>-<hash>/out`
/// (so every profile, feature set and calling package shares one build of
/// `core` for the GPU), else (an unknown layout) inside `OUT_DIR`, private to
/// this build.
pub fn kernels_target_dir(out_dir: &Path) -> PathBuf {
    let build = out_dir.parent().and_then(Path::parent);
    match build.and_then(|b| Some((b.file_name()?, b.parent()?.parent()?))) {
        Some((name, target)) if name == "build" => target.join("nvptx-kernels"),
        _ => out_dir.join("kernels-target"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use std::ffi::OsStr;

    #[test]
    fn outer_build_variables_are_recognised() {
        for outer in [
            "CARGO_PKG_NAME",
            "CARGO_ENCODED_RUSTFLAGS",
            "CARGO_MAKEFLAGS",
            "CARGO_TARGET_DIR",
            "CARGO_PROFILE_RELEASE_LTO",
            "RUSTC",
            "RUSTC_WRAPPER",
            "RUSTC_WORKSPACE_WRAPPER",
            "RUSTC_BOOTSTRAP",
            "RUSTFLAGS",
            "RUSTDOCFLAGS",
            "DEP_Z_INCLUDE",
            "OUT_DIR",
        ] {
            assert!(is_outer_build_var(outer), "{outer}");
        }
        for kept in [
            "CARGO",
            "RUSTUP_TOOLCHAIN",
            "RUSTUP_HOME",
            "CARGO_HOME",
            "CARGO_NET_OFFLINE",
            "CARGO_HTTP_TIMEOUT",
            "CARGO_REGISTRIES_CRATES_IO_PROTOCOL",
            "PATH",
            "HOME",
            "KERNEL_ARCH",
        ] {
            assert!(!is_outer_build_var(kept), "{kept}");
        }
    }

    #[test]
    fn the_command_clears_the_outer_build_and_sets_its_own() {
        let outer = [
            "CARGO_PKG_NAME",
            "RUSTFLAGS",
            "RUSTC_WRAPPER",
            "CARGO_ENCODED_RUSTFLAGS",
            "PATH",
            "RUSTUP_TOOLCHAIN",
        ]
        .map(String::from);
        let cmd = nested_command(
            "/bin/cargo",
            Path::new("/k"),
            Path::new("/t/sm_70"),
            "-Ctarget-cpu=sm_70",
            outer,
        );
        assert_eq!(cmd.get_program(), OsStr::new("/bin/cargo"));
        assert_eq!(cmd.get_current_dir(), Some(Path::new("/k")));
        let args: Vec<_> = cmd.get_args().map(|a| a.to_string_lossy()).collect();
        assert_eq!(
            args,
            [
                "rustc",
                "--lib",
                "--release",
                "--crate-type",
                "cdylib",
                "--target",
                "nvptx64-nvidia-cuda",
                "-Zbuild-std=core",
                "--manifest-path",
                "/k/Cargo.toml",
                "--target-dir",
                "/t/sm_70"
            ]
        );
        let envs: BTreeMap<String, Option<String>> = cmd
            .get_envs()
            .map(|(k, v)| {
                (
                    k.to_string_lossy().into_owned(),
                    v.map(|v| v.to_string_lossy().into_owned()),
                )
            })
            .collect();
        // Removed: the outer build's.
        assert_eq!(envs["CARGO_PKG_NAME"], None);
        assert_eq!(envs["RUSTFLAGS"], None);
        assert_eq!(envs["RUSTC_WRAPPER"], None);
        // Untouched: everything else (the toolchain pin included).
        assert!(!envs.contains_key("PATH"));
        assert!(!envs.contains_key("RUSTUP_TOOLCHAIN"));
        // Set: the nested build's own (a removed key set again wins).
        let set = |k: &str| envs.get(k).cloned().flatten();
        assert_eq!(
            set("CARGO_ENCODED_RUSTFLAGS").as_deref(),
            Some("-Ctarget-cpu=sm_70")
        );
        assert_eq!(set("RUSTC_BOOTSTRAP").as_deref(), Some("1"));
        assert_eq!(set("CARGO_PROFILE_RELEASE_LTO").as_deref(), Some("fat"));
        assert_eq!(
            set("CARGO_PROFILE_RELEASE_CODEGEN_UNITS").as_deref(),
            Some("1")
        );
        assert_eq!(set("CARGO_PROFILE_RELEASE_DEBUG").as_deref(), Some("false"));
    }

    #[test]
    fn nested_builds_share_a_directory_next_to_the_profiles() {
        assert_eq!(
            kernels_target_dir(Path::new("/w/target/debug/build/host-0123/out")),
            Path::new("/w/target/nvptx-kernels")
        );
        assert_eq!(
            kernels_target_dir(Path::new(
                "/w/target/x86_64-unknown-linux-gnu/release/build/host-0123/out"
            )),
            Path::new("/w/target/x86_64-unknown-linux-gnu/nvptx-kernels")
        );
        // An unknown layout: private to this OUT_DIR.
        assert_eq!(
            kernels_target_dir(Path::new("/tmp/out")),
            Path::new("/tmp/out/kernels-target")
        );
        assert_eq!(
            artifact_dir(Path::new("/t/sm_70")),
            Path::new("/t/sm_70/nvptx64-nvidia-cuda/release")
        );
    }
}
