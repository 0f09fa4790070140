//! What can go wrong in a kernel build, each error with its message: what
//! happened and what to do about it.

use crate::hint::MissingComponent;
use std::path::PathBuf;
use std::process::ExitStatus;

/// What went wrong, with what to do about it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A variable cargo sets for build scripts is missing: the builder was
    /// called outside one.
    #[error(
        "{var} is not set: kernel_builder::Builder::build runs inside a build script (build.rs), \
         where cargo sets it"
    )]
    NotInBuildScript {
        /// The variable (`OUT_DIR`, `CARGO_MANIFEST_DIR`).
        var: &'static str,
    },
    /// The path given to [`Builder::new`](crate::Builder::new) holds no `Cargo.toml`.
    #[error(
        "no kernel crate at {}: there is no Cargo.toml there (a relative path is taken from the \
         calling crate's directory)",
        path.display()
    )]
    NoKernelCrate {
        /// Where it was looked for.
        path: PathBuf,
    },
    /// The kernel crate's `Cargo.toml` names no package or library.
    #[error(
        "{}: no package name found ([package] or [lib] `name = \"...\"`); name the library with \
         Builder::lib_name",
        path.display()
    )]
    NoLibName {
        /// The manifest.
        path: PathBuf,
    },
    /// An architecture that is not `sm_` and a number.
    #[error("{origin}={value:?} is not a GPU architecture: use a value like sm_70 or sm_90")]
    BadArch {
        /// `KERNEL_ARCH` or `Builder::arch`.
        origin: &'static str,
        /// What was given.
        value: String,
    },
    /// A PTX ISA that is not `ptx` and a number.
    #[error(
        "{origin}={value:?} is not a PTX ISA target feature: use a value like ptx78 or ptx80, or \
         leave it unset for the lowest the architecture allows"
    )]
    BadPtxIsa {
        /// `KERNEL_PTX_ISA` or `Builder::ptx_isa`.
        origin: &'static str,
        /// What was given.
        value: String,
    },
    /// Cargo could not be started.
    #[error("could not start `{cargo}` for the nested kernel build: {source}")]
    Spawn {
        /// The program (the outer build's `CARGO`).
        cargo: String,
        /// Why.
        source: std::io::Error,
    },
    /// The nested build failed: its errors, and a fix-it hint.
    #[error(
        "the nested nvptx64 build of {} failed ({status})\n\n{stderr}\n{}",
        krate.display(),
        missing.hint()
    )]
    NestedBuild {
        /// The kernel crate.
        krate: PathBuf,
        /// Cargo's exit status.
        status: ExitStatus,
        /// Cargo's standard error.
        stderr: String,
        /// The component the errors point at, if any.
        missing: MissingComponent,
    },
    /// The nested build succeeded but left no PTX where expected.
    #[error(
        "the nested build succeeded but {} is unreadable: {source} (is the library name right? \
         see Builder::lib_name)",
        path.display()
    )]
    MissingPtx {
        /// Where the PTX was expected.
        path: PathBuf,
        /// Why it can't be read.
        source: std::io::Error,
    },
    /// The nested build's dep-info file can't be read.
    #[error("reading dep-info {}: {source}", path.display())]
    DepInfo {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A file could not be written.
    #[error("writing {}: {source}", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The PTX has no kernel.
    #[error(
        "{}: the PTX has no kernel entry point (`.entry`): declare kernels with \
         kernel_abi::kernels! (or `#[no_mangle] pub unsafe extern \"ptx-kernel\" fn`), with \
         #![feature(abi_ptx)] when built for nvptx64",
        path.display()
    )]
    NoEntryPoints {
        /// The PTX.
        path: PathBuf,
    },
    /// Entry points [`Builder::expect_entries`](crate::Builder::expect_entries) named are missing.
    #[error("{}: the PTX lacks the entry points {missing:?} (it has {found:?})", path.display())]
    MissingEntries {
        /// The PTX.
        path: PathBuf,
        /// Asked for, absent.
        missing: Vec<String>,
        /// Present.
        found: Vec<String>,
    },
    /// The PTX's `.target` is not the architecture asked for.
    #[error("{}: the PTX targets {found:?}, not {expected}", path.display())]
    WrongTarget {
        /// The PTX.
        path: PathBuf,
        /// Asked for.
        expected: String,
        /// The `.target` found.
        found: Option<String>,
    },
    /// The PTX calls functions it does not define.
    #[error(
        "{}: the PTX calls functions it does not define, so the driver would refuse to load it \
         (unresolved extern): {externs:?}. Usually a function of `std` or a math routine the \
         nvptx64 backend has no instruction for; use `core` only (e.g. core::f32::math with \
         #![feature(core_float_math)]), or allow it with Builder::allow_externs",
        path.display()
    )]
    UnresolvedExterns {
        /// The PTX.
        path: PathBuf,
        /// The `.extern .func` declarations.
        externs: Vec<String>,
    },
}

/// A `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
