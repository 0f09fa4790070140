//! Build a Rust kernel crate to PTX from any crate's `build.rs`, in the
//! spirit of rust-gpu's `spirv-builder`: point it at the kernel crate, get
//! the PTX in `OUT_DIR` to embed with `include_str!`.
//!
//! ```no_run
//! // build.rs of the crate that launches the kernels, in its `fn main`:
//! kernel_builder::Builder::new("../my-kernels")
//!     .arch("sm_70")
//!     .build_or_exit();
//! ```
//! ```ignore
//! // src/lib.rs: `<lib name>.ptx`, the kernel crate's library name
//! pub const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/my_kernels.ptx"));
//! ```
//!
//! The kernel crate is compiled by rustc's own `nvptx64-nvidia-cuda` backend
//! in a nested cargo build: `cargo rustc --lib --release --crate-type cdylib
//! --target nvptx64-nvidia-cuda -Zbuild-std=core`, in a target directory of
//! its own (the outer build holds the lock on its own), with the outer
//! build's `CARGO_*` / `RUSTC*` / `RUSTFLAGS` variables cleared, its flags
//! passed through `CARGO_ENCODED_RUSTFLAGS`, `RUSTC_BOOTSTRAP=1` for the
//! nested build only (the `abi_ptx` / `stdarch_nvptx` features and
//! `-Zbuild-std`; the calling crate stays on plain stable), and fat LTO in
//! one codegen unit (a kernel edit rebuilds in seconds).
//!
//! The toolchain needs the rustup components `rust-src`,
//! `llvm-bitcode-linker` and `llvm-tools`; when one is missing the error
//! says which and how to install it ([`MissingComponent`]).
//!
//! # Knobs (each reruns the build script when it changes)
//! - `KERNEL_ARCH`: the PTX `.target`; overrides [`Builder::arch`]; default
//!   `sm_70` (every GPU from Volta on can JIT it).
//! - `KERNEL_PTX_ISA`: the PTX ISA version as a target feature, e.g.
//!   `ptx80`; overrides [`Builder::ptx_isa`]; default: the lowest the
//!   architecture allows (`.version 6.0` for sm_70).
//! - `HOST_PTX_STUB=1`: nothing is built; the PTX file holds one comment
//!   (for tools that can't run the nvptx build, such as Miri), and
//!   [`Built::stub`] says so.
//!
//! # Rebuild triggers
//! The build script reruns when a source of the kernel crate or of its path
//! dependencies changes (read from the nested build's dep-info), when one
//! of their `Cargo.toml`s or the workspace's `Cargo.lock` changes, when the
//! calling crate's `build.rs` changes, and when a knob changes.
//!
//! # Where the nested build goes
//! One directory per architecture next to the profile directories
//! (`target/nvptx-kernels/sm_70`), shared by every profile, feature set and
//! calling crate: `core` is compiled for the GPU once (the long part of a
//! first build, announced by one status line), not once per profile.

mod command;
mod config;
mod depinfo;
mod git;
mod hint;
mod manifest;
mod notice;
pub mod ptx;

pub use command::{
    artifact_dir, is_outer_build_var, kernels_target_dir, nested_args, nested_env, TARGET,
    USER_CARGO_SETTINGS,
};
pub use config::{is_gpu_arch, is_ptx_isa, DEFAULT_ARCH, ENV_ARCH, ENV_PTX_ISA, ENV_STUB};
pub use depinfo::{packages as dep_info_packages, parse as parse_dep_info};
pub use git::{git_commit, WORKSPACE_FILES};
pub use hint::MissingComponent;
pub use manifest::lib_name;
pub use notice::notice;

/// Whether this machine shows an NVIDIA GPU to the driver
/// (`/proc/driver/nvidia/gpus` lists one).
pub fn gpu_present() -> bool {
    std::fs::read_dir("/proc/driver/nvidia/gpus").is_ok_and(|mut d| d.next().is_some())
}

/// For a build script: declares the cfg `name` and sets it when the building
/// machine has a GPU, or when `REQUIRE_GPU=1` is set for the build, so tests
/// can mark their GPU halves `#[cfg_attr(not(name), ignore)]`: shown as
/// ignored, not passed, on a machine without one; run (and failing without
/// a GPU) when the GPU is required.
pub fn emit_gpu_cfg(name: &str) {
    println!("cargo:rustc-check-cfg=cfg({name})");
    println!("cargo:rerun-if-env-changed=REQUIRE_GPU");
    if gpu_present() || gpu_required() {
        println!("cargo:rustc-cfg={name}");
    }
}

/// Whether `REQUIRE_GPU=1` is set: GPU tests must run (and fail without a
/// GPU) instead of being skipped.
pub fn gpu_required() -> bool {
    std::env::var("REQUIRE_GPU").is_ok_and(|v| v == "1")
}

use config::Knobs;
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};
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
    /// The path given to [`Builder::new`] holds no `Cargo.toml`.
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
    /// Entry points [`Builder::expect_entries`] named are missing.
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

/// A snapshot of the environment variables the builder reads.
#[derive(Clone, Debug, Default)]
pub struct Env {
    vars: BTreeMap<String, OsString>,
}

impl Env {
    /// This process's environment (a variable with a non-UTF-8 name is kept
    /// under its lossy name, so it is still cleared when it should be).
    pub fn process() -> Env {
        Env {
            vars: std::env::vars_os()
                .map(|(k, v)| (k.to_string_lossy().into_owned(), v))
                .collect(),
        }
    }

    /// An environment of the given pairs only (for tests).
    pub fn from_pairs<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> Env {
        Env {
            vars: pairs
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.into()))
                .collect(),
        }
    }

    /// A variable's value, when it is UTF-8.
    pub fn var(&self, key: &str) -> Option<String> {
        self.vars
            .get(key)
            .and_then(|v| v.to_str())
            .map(String::from)
    }

    /// Every variable's name.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.vars.keys().map(String::as_str)
    }

    /// A path variable (any bytes).
    fn path(&self, var: &'static str) -> Result<PathBuf> {
        self.vars
            .get(var)
            .map(PathBuf::from)
            .ok_or(Error::NotInBuildScript { var })
    }
}

/// Builds one kernel crate to PTX. See the [crate] docs.
#[derive(Clone, Debug)]
pub struct Builder {
    krate: PathBuf,
    arch: Option<String>,
    ptx_isa: Option<String>,
    use_env: bool,
    lib_name: Option<String>,
    file_name: Option<String>,
    target_dir: Option<PathBuf>,
    export_arch: Option<String>,
    expect_entries: Vec<String>,
    allow_externs: bool,
    announce: bool,
}

/// What a build produced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Built {
    /// The PTX file in `OUT_DIR` (`OUT_DIR/<file name>`).
    pub ptx: PathBuf,
    /// Its name, for `include_str!(concat!(env!("OUT_DIR"), "/", <name>))`.
    pub file_name: String,
    /// The `.target` architecture (`none` in stub mode).
    pub arch: String,
    /// The PTX ISA feature asked for, if any.
    pub ptx_isa: Option<String>,
    /// Whether `HOST_PTX_STUB=1` made this a stub (no kernels).
    pub stub: bool,
    /// The PTX's entry points, in order.
    pub entries: Vec<String>,
    /// The local source files the kernel build read (the kernel crate's and
    /// its path dependencies').
    pub sources: Vec<PathBuf>,
    /// Their package directories (the kernel crate first).
    pub packages: Vec<PathBuf>,
    /// The calling crate's directory (`CARGO_MANIFEST_DIR`).
    pub manifest_dir: PathBuf,
}

impl Built {
    /// The commit for results files: [`git_commit`] over the calling
    /// crate's and the kernel build's packages, in the workspace holding
    /// the calling crate (the nearest directory with a `Cargo.lock`); `stub`
    /// in stub mode. Prints its own `rerun-if-changed` lines.
    pub fn git_commit(&self) -> String {
        if self.stub {
            return "stub".into();
        }
        let workspace = self
            .manifest_dir
            .ancestors()
            .find(|d| d.join("Cargo.lock").is_file())
            .unwrap_or(&self.manifest_dir);
        let mut packages = vec![self.manifest_dir.clone()];
        packages.extend(self.packages.iter().cloned());
        git_commit(workspace, &packages)
    }
}

impl Builder {
    /// A build of the kernel crate at `krate` (its directory; a relative
    /// path is taken from the calling crate's `CARGO_MANIFEST_DIR`).
    pub fn new(krate: impl Into<PathBuf>) -> Builder {
        Builder {
            krate: krate.into(),
            arch: None,
            ptx_isa: None,
            use_env: true,
            lib_name: None,
            file_name: None,
            target_dir: None,
            export_arch: None,
            expect_entries: Vec::new(),
            allow_externs: false,
            announce: true,
        }
    }

    /// The architecture (`sm_70`, `sm_90`), unless `KERNEL_ARCH` overrides
    /// it; default [`DEFAULT_ARCH`].
    pub fn arch(mut self, arch: impl Into<String>) -> Builder {
        self.arch = Some(arch.into());
        self
    }

    /// The PTX ISA target feature (`ptx80`), unless `KERNEL_PTX_ISA`
    /// overrides it; default: the lowest the architecture allows.
    pub fn ptx_isa(mut self, isa: impl Into<String>) -> Builder {
        self.ptx_isa = Some(isa.into());
        self
    }

    /// Whether the environment's knobs (`KERNEL_ARCH`, `KERNEL_PTX_ISA`,
    /// `HOST_PTX_STUB`) apply; default yes. Off, the builder's values are
    /// final and the knobs are not watched.
    pub fn env_knobs(mut self, on: bool) -> Builder {
        self.use_env = on;
        self
    }

    /// The kernel crate's library name, when its `Cargo.toml` can't be read
    /// for it (by default: `[lib] name`, else the package name with `-` as
    /// `_`).
    pub fn lib_name(mut self, name: impl Into<String>) -> Builder {
        self.lib_name = Some(name.into());
        self
    }

    /// The PTX's file name in `OUT_DIR`; default `<lib name>.ptx`.
    pub fn file_name(mut self, name: impl Into<String>) -> Builder {
        self.file_name = Some(name.into());
        self
    }

    /// The nested build's target directory (one subdirectory per flag set
    /// is made inside it); default [`kernels_target_dir`] of `OUT_DIR`.
    pub fn target_dir(mut self, dir: impl Into<PathBuf>) -> Builder {
        self.target_dir = Some(dir.into());
        self
    }

    /// Also sets the architecture as a compile-time variable of the calling
    /// crate (`cargo:rustc-env=<name>=sm_70`; `none` in stub mode), for
    /// `env!(name)`.
    pub fn export_arch(mut self, name: impl Into<String>) -> Builder {
        self.export_arch = Some(name.into());
        self
    }

    /// Entry points the PTX must have (the build fails naming the missing
    /// ones); by default any one.
    pub fn expect_entries<S: Into<String>>(
        mut self,
        names: impl IntoIterator<Item = S>,
    ) -> Builder {
        self.expect_entries = names.into_iter().map(Into::into).collect();
        self
    }

    /// Lets PTX with `.extern .func` declarations through (a module linked
    /// with others at load time); by default they fail the build, since the
    /// driver refuses to load such PTX alone.
    pub fn allow_externs(mut self, allow: bool) -> Builder {
        self.allow_externs = allow;
        self
    }

    /// Whether a first build (or one with a new toolchain or flag set, which
    /// compiles `core` for the GPU, a minute or two) announces itself with
    /// one status line on cargo's terminal ([`notice`]); default yes.
    pub fn announce(mut self, on: bool) -> Builder {
        self.announce = on;
        self
    }

    /// Builds the kernel crate and writes its PTX into `OUT_DIR`, printing
    /// the `cargo:` directives of a build script on stdout.
    ///
    /// # Errors
    /// Every [`Error`]: outside a build script, a bad knob, a failed nested
    /// build (with its errors and a fix-it hint), PTX without the kernels.
    pub fn build(&self) -> Result<Built> {
        self.build_in(&Env::process(), &mut std::io::stdout().lock())
    }

    /// [`Builder::build`], and on an error what a build script does: print
    /// it and exit with status 1 (cargo shows the message, without a panic's
    /// backtrace noise).
    pub fn build_or_exit(&self) -> Built {
        match self.build() {
            Ok(built) => built,
            Err(e) => {
                eprintln!("\nerror: building the GPU kernels failed\n\n{e}\n");
                std::process::exit(1)
            }
        }
    }

    /// [`Builder::build`] with a given environment, printing the directives
    /// to `out`.
    ///
    /// # Errors
    /// As [`Builder::build`].
    pub fn build_in(&self, env: &Env, out: &mut dyn Write) -> Result<Built> {
        let manifest_dir = env.path("CARGO_MANIFEST_DIR")?;
        let out_dir = env.path("OUT_DIR")?;
        let krate = manifest_dir.join(&self.krate);
        let krate = krate.canonicalize().unwrap_or(krate);
        let manifest = krate.join("Cargo.toml");
        if !manifest.is_file() {
            return Err(Error::NoKernelCrate { path: krate });
        }
        let lib = match &self.lib_name {
            Some(name) => name.clone(),
            None => std::fs::read_to_string(&manifest)
                .ok()
                .and_then(|m| lib_name(&m))
                .ok_or_else(|| Error::NoLibName {
                    path: manifest.clone(),
                })?,
        };
        let file_name = self
            .file_name
            .clone()
            .unwrap_or_else(|| format!("{lib}.ptx"));
        let dest = out_dir.join(&file_name);
        // Directives: a failed write to stdout is cargo's problem, not ours.
        let mut emit = |line: String| {
            let _ = writeln!(out, "cargo:{line}");
        };

        if self.use_env {
            emit(format!("rerun-if-env-changed={ENV_ARCH}"));
            emit(format!("rerun-if-env-changed={ENV_STUB}"));
        }
        if self.use_env && env.var(ENV_STUB).is_some_and(|v| v == "1") {
            // For tools that cannot run the nvptx build (Miri runs the
            // CUDA-free parts of a crate): no kernels, and every use of the
            // PTX fails loudly.
            emit(format!(
                "warning={ENV_STUB}=1: the {lib} kernels were not built; the embedded PTX is empty"
            ));
            let stub = format!("// {ENV_STUB}=1: kernels not built\n");
            write_if_changed(&dest, &stub)?;
            if let Some(name) = &self.export_arch {
                emit(format!("rustc-env={name}=none"));
            }
            return Ok(Built {
                ptx: dest,
                file_name,
                arch: "none".into(),
                ptx_isa: None,
                stub: true,
                entries: Vec::new(),
                sources: Vec::new(),
                packages: vec![krate],
                manifest_dir,
            });
        }
        if self.use_env {
            emit(format!("rerun-if-env-changed={ENV_PTX_ISA}"));
        }
        emit(format!("rerun-if-changed={}", manifest.display()));
        if manifest_dir.join("build.rs").is_file() {
            emit("rerun-if-changed=build.rs".into());
        }

        let knobs = Knobs::resolve(
            self.arch.as_deref(),
            self.ptx_isa.as_deref(),
            self.use_env,
            env,
        )?;
        let rustflags = knobs.encoded_rustflags();
        let target_dir = self
            .target_dir
            .clone()
            .unwrap_or_else(|| kernels_target_dir(&out_dir))
            .join(knobs.dir_name());

        // A first build (or a new toolchain or flag set) compiles `core` for
        // the GPU: say so before it starts, since cargo shows nothing but
        // its progress bar meanwhile.
        let stamp = target_dir.join("kernel-builder.stamp");
        let stamp_text = format!("{rustflags}\n{}", rustc_version(env));
        if self.announce
            && std::fs::read_to_string(&stamp).ok().as_deref() != Some(stamp_text.as_str())
        {
            notice(&notice::first_build_line(&lib, &knobs.arch));
        }

        let cargo = env.var("CARGO").unwrap_or_else(|| "cargo".into());
        let mut cmd = command::nested_command(
            &cargo,
            &krate,
            &target_dir,
            &rustflags,
            env.keys().map(String::from),
        );
        let output = cmd.output().map_err(|source| Error::Spawn {
            cargo: cargo.clone(),
            source,
        })?;
        if !output.status.success() {
            let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
            return Err(Error::NestedBuild {
                krate,
                status: output.status,
                missing: MissingComponent::diagnose(&stderr),
                stderr,
            });
        }
        // Best effort: without it the next build only announces itself again.
        let _ = std::fs::write(&stamp, &stamp_text);

        let built = artifact_dir(&target_dir);
        let ptx_path = built.join(format!("{lib}.ptx"));
        let text = std::fs::read_to_string(&ptx_path).map_err(|source| Error::MissingPtx {
            path: ptx_path.clone(),
            source,
        })?;
        let entries = ptx::check(
            &text,
            &ptx_path,
            &ptx::Expect {
                arch: &knobs.arch,
                entries: &self.expect_entries,
                allow_externs: self.allow_externs,
            },
        )?;
        write_if_changed(&dest, &text)?;

        let sources = depinfo::sources(&built.join(format!("{lib}.d")))?;
        for source in &sources {
            emit(format!("rerun-if-changed={}", source.display()));
        }
        let mut packages = vec![krate.clone()];
        for p in depinfo::packages(&sources) {
            if !packages.contains(&p) {
                emit(format!(
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
            emit(format!("rerun-if-changed={}", lock.display()));
        }
        if let Some(name) = &self.export_arch {
            emit(format!("rustc-env={name}={}", knobs.arch));
        }
        Ok(Built {
            ptx: dest,
            file_name,
            arch: knobs.arch,
            ptx_isa: knobs.isa,
            stub: false,
            entries,
            sources,
            packages,
            manifest_dir,
        })
    }
}

/// Writes `text` to `path` unless it already holds exactly that (a
/// rewrite would only bump its modification time).
fn write_if_changed(path: &Path, text: &str) -> Result<()> {
    if std::fs::read_to_string(path).ok().as_deref() == Some(text) {
        return Ok(());
    }
    std::fs::write(path, text).map_err(|source| Error::Write {
        path: path.into(),
        source,
    })
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

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kb-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A calling crate and a kernel crate side by side, and an OUT_DIR.
    fn layout(name: &str) -> (PathBuf, PathBuf, PathBuf) {
        let root = scratch(name);
        let (caller, kernels, out) = (
            root.join("caller"),
            root.join("my-kernels"),
            root.join("out"),
        );
        for d in [&caller, &kernels.join("src"), &out] {
            std::fs::create_dir_all(d).unwrap();
        }
        std::fs::write(caller.join("build.rs"), "fn main() {}\n").unwrap();
        std::fs::write(
            kernels.join("Cargo.toml"),
            "[package]\nname = \"my-kernels\"\nversion = \"0.1.0\"\n",
        )
        .unwrap();
        (caller, kernels, out)
    }

    fn env_of(caller: &Path, out: &Path, extra: &[(&str, &str)]) -> Env {
        let (caller, out) = (caller.to_string_lossy(), out.to_string_lossy());
        let mut pairs = vec![("CARGO_MANIFEST_DIR", &*caller), ("OUT_DIR", &*out)];
        pairs.extend_from_slice(extra);
        Env::from_pairs(pairs)
    }

    #[test]
    fn outside_a_build_script_the_error_says_so() {
        let e = Builder::new("k")
            .build_in(&Env::default(), &mut Vec::new())
            .unwrap_err();
        assert!(matches!(
            e,
            Error::NotInBuildScript {
                var: "CARGO_MANIFEST_DIR"
            }
        ));
        assert!(e.to_string().contains("build script"), "{e}");
    }

    #[test]
    fn a_missing_kernel_crate_is_named() {
        let (caller, _, out) = layout("missing");
        let e = Builder::new("../nowhere")
            .build_in(&env_of(&caller, &out, &[]), &mut Vec::new())
            .unwrap_err();
        assert!(
            matches!(&e, Error::NoKernelCrate { path } if path.ends_with("nowhere")),
            "{e}"
        );
    }

    #[test]
    fn stub_mode_writes_a_stub_and_watches_the_knobs() {
        let (caller, _, out) = layout("stub");
        let env = env_of(&caller, &out, &[(ENV_STUB, "1"), (ENV_ARCH, "not-checked")]);
        let mut directives = Vec::new();
        let built = Builder::new("../my-kernels")
            .export_arch("KERNEL_ARCH")
            .build_in(&env, &mut directives)
            .unwrap();
        assert!(built.stub);
        assert_eq!(built.file_name, "my_kernels.ptx");
        assert_eq!(built.ptx, out.join("my_kernels.ptx"));
        assert_eq!(built.git_commit(), "stub");
        let text = std::fs::read_to_string(&built.ptx).unwrap();
        assert!(text.starts_with("// HOST_PTX_STUB=1"), "{text}");
        assert!(ptx::entry_points(&text).is_empty());
        let directives = String::from_utf8(directives).unwrap();
        assert_eq!(
            directives.lines().collect::<Vec<_>>(),
            [
                "cargo:rerun-if-env-changed=KERNEL_ARCH",
                "cargo:rerun-if-env-changed=HOST_PTX_STUB",
                "cargo:warning=HOST_PTX_STUB=1: the my_kernels kernels were not built; the embedded PTX is empty",
                "cargo:rustc-env=KERNEL_ARCH=none",
            ]
        );
    }

    #[test]
    fn a_bad_knob_fails_before_any_build_with_the_triggers_printed() {
        let (caller, _, out) = layout("badknob");
        let env = env_of(&caller, &out, &[(ENV_ARCH, "hopper")]);
        let mut directives = Vec::new();
        let e = Builder::new("../my-kernels")
            .file_name("k.ptx")
            .build_in(&env, &mut directives)
            .unwrap_err();
        assert!(
            matches!(
                &e,
                Error::BadArch {
                    origin: "KERNEL_ARCH",
                    ..
                }
            ),
            "{e}"
        );
        let directives = String::from_utf8(directives).unwrap();
        for want in [
            "cargo:rerun-if-env-changed=KERNEL_ARCH",
            "cargo:rerun-if-env-changed=HOST_PTX_STUB",
            "cargo:rerun-if-env-changed=KERNEL_PTX_ISA",
            "cargo:rerun-if-changed=build.rs",
        ] {
            assert!(
                directives.lines().any(|l| l == want),
                "{want} in {directives}"
            );
        }
        assert!(directives.contains("my-kernels/Cargo.toml"), "{directives}");
        assert!(!out.join("k.ptx").exists());
    }

    #[test]
    fn without_env_knobs_the_environment_is_neither_read_nor_watched() {
        let (caller, _, out) = layout("noenv");
        // The stub switch is ignored too: the bad builder arch proves no
        // stub was written and the builder's own value was used.
        let env = env_of(&caller, &out, &[(ENV_STUB, "1")]);
        let mut directives = Vec::new();
        let e = Builder::new("../my-kernels")
            .arch("volta")
            .env_knobs(false)
            .build_in(&env, &mut directives)
            .unwrap_err();
        assert!(matches!(
            e,
            Error::BadArch {
                origin: "Builder::arch",
                ..
            }
        ));
        let directives = String::from_utf8(directives).unwrap();
        assert!(!directives.contains("rerun-if-env-changed"), "{directives}");
    }

    #[test]
    fn a_failing_nested_build_reports_its_errors_with_a_hint() {
        let (caller, _, out) = layout("fails");
        // A "cargo" that fails the way a toolchain without rust-src does.
        let fake = caller.join("fake-cargo.sh");
        std::fs::write(
            &fake,
            "#!/bin/sh\necho 'error: \"/x/library/Cargo.lock\" does not exist, unable to build with the standard library, try:\n        rustup component add rust-src' >&2\nexit 101\n",
        )
        .unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        let fake = fake.to_string_lossy().into_owned();
        let env = env_of(&caller, &out, &[("CARGO", &fake)]);
        let e = Builder::new("../my-kernels")
            .announce(false)
            .target_dir(out.join("nested"))
            .build_in(&env, &mut Vec::new())
            .unwrap_err();
        let Error::NestedBuild {
            missing, stderr, ..
        } = &e
        else {
            panic!("{e}");
        };
        assert_eq!(*missing, MissingComponent::RustSrc);
        assert!(stderr.contains("unable to build with the standard library"));
        let text = e.to_string();
        assert!(
            text.contains("hint: the `rust-src` component is missing"),
            "{text}"
        );

        let env = env_of(&caller, &out, &[("CARGO", "/nonexistent/cargo")]);
        let e = Builder::new("../my-kernels")
            .announce(false)
            .target_dir(out.join("nested"))
            .build_in(&env, &mut Vec::new())
            .unwrap_err();
        assert!(matches!(e, Error::Spawn { .. }), "{e}");
    }

    #[test]
    fn a_successful_build_is_checked_copied_and_watched() {
        let (caller, kernels, out) = layout("ok");
        let src = kernels.join("src/lib.rs");
        std::fs::write(&src, "").unwrap();
        let nested = out.join("nested");
        // A "cargo" that leaves what the real one does: the PTX and its dep-info.
        let release = artifact_dir(&nested.join("sm_80"));
        let fake = caller.join("fake-cargo.sh");
        let ptx = ".version 7.0\\n.target sm_80\\n.address_size 64\\n.visible .entry widen(\\n)\\n{\\n\\tret;\\n}\\n";
        std::fs::write(
            &fake,
            format!(
                "#!/bin/sh\n[ \"$RUSTC_BOOTSTRAP\" = 1 ] || exit 3\n[ -z \"$CARGO_PKG_NAME\" ] || exit 4\n\
                 mkdir -p {r}\nprintf '{ptx}' > {r}/my_kernels.ptx\n\
                 printf '{r}/my_kernels.ptx: {s}\\n' > {r}/my_kernels.d\n",
                r = release.display(),
                s = src.display()
            ),
        )
        .unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        let fake = fake.to_string_lossy().into_owned();
        let env = env_of(
            &caller,
            &out,
            &[
                ("CARGO", &fake),
                ("CARGO_PKG_NAME", "caller"),
                (ENV_ARCH, "sm_80"),
            ],
        );
        let mut directives = Vec::new();
        let built = Builder::new("../my-kernels")
            .announce(false)
            .arch("sm_70")
            .target_dir(&nested)
            .export_arch("MY_ARCH")
            .expect_entries(["widen"])
            .build_in(&env, &mut directives)
            .unwrap();
        assert!(!built.stub);
        assert_eq!(built.arch, "sm_80");
        assert_eq!(built.entries, ["widen"]);
        assert_eq!(built.ptx, out.join("my_kernels.ptx"));
        assert!(std::fs::read_to_string(&built.ptx)
            .unwrap()
            .contains(".target sm_80"));
        let kernels = kernels.canonicalize().unwrap();
        assert_eq!(built.packages, [kernels]);
        let directives = String::from_utf8(directives).unwrap();
        assert!(
            directives.contains(&format!("cargo:rerun-if-changed={}\n", src.display())),
            "{directives}"
        );
        assert!(
            directives.contains("cargo:rustc-env=MY_ARCH=sm_80\n"),
            "{directives}"
        );

        // Entry points asked for but absent fail the build.
        let e = Builder::new("../my-kernels")
            .announce(false)
            .target_dir(&nested)
            .expect_entries(["widen", "narrow"])
            .build_in(&env, &mut Vec::new())
            .unwrap_err();
        assert!(
            matches!(&e, Error::MissingEntries { missing, .. } if missing == &["narrow"]),
            "{e}"
        );
    }
}
