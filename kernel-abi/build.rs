//! Publishes where this crate's sources are (`cargo:manifest_dir`, seen by
//! the build scripts of crates depending on it as
//! `DEP_<LINKS>_MANIFEST_DIR`), so that a crate embedding the kernels' PTX
//! builds them from the very sources cargo resolved: a path in this
//! workspace, a git checkout or the registry's unpacked package.

fn main() {
    if let Some(dir) = std::env::var_os("CARGO_MANIFEST_DIR") {
        println!(
            "cargo:manifest_dir={}",
            std::path::Path::new(&dir).display()
        );
    }
    println!("cargo:rerun-if-changed=build.rs");
}
