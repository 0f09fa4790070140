//! The builder: what to build and how, and the build itself, step by step
//! (the knobs, the nested build, the PTX checks, the rerun triggers).

use crate::command::kernels_target_dir;
use crate::config::{Knobs, ENV_ARCH, ENV_PTX_ISA, ENV_STUB};
use crate::git::git_commit;
use crate::manifest::lib_name;
use crate::reruns::Directives;
use crate::{env::Env, error::Error, error::Result, nested, ptx, reruns};
use std::io::Write;
use std::path::{Path, PathBuf};

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
    patches: Vec<(String, PathBuf)>,
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
            patches: Vec::new(),
        }
    }

    /// A build of a kernel crate that is also a dependency of the calling
    /// crate, found where cargo put that dependency's sources: the directory
    /// the dependency's build script published as `cargo:manifest_dir`
    /// (visible here as `DEP_<LINKS>_MANIFEST_DIR`, `<LINKS>` its `links`
    /// key, upper case). This is how a packaged crate builds its kernels: the
    /// kernel crate comes from the registry, or a git checkout, or a path,
    /// and the build follows it there. `fallback` (relative to the calling
    /// crate) is used where the variable is absent.
    pub fn from_dependency(links: &str, fallback: impl Into<PathBuf>) -> Builder {
        let var = format!(
            "DEP_{}_MANIFEST_DIR",
            links.to_uppercase().replace('-', "_")
        );
        match std::env::var_os(&var) {
            Some(dir) => Builder::new(PathBuf::from(dir)),
            None => Builder::new(fallback),
        }
    }

    /// Resolves the kernel crate's dependency `name` to the sources in `dir`
    /// in the nested build (`--config patch.crates-io.<name>.path=<dir>`).
    /// A kernel crate taken from a registry names its own dependencies by
    /// version; patched to the sources the calling build already has, the
    /// nested build needs no registry for them (and a crate that is not
    /// published yet, as in `cargo package`'s verification, resolves).
    /// Unused where the kernel crate names the dependency by path (cargo
    /// warns of an unused patch, and the build goes on).
    pub fn patch(mut self, name: impl Into<String>, dir: impl Into<PathBuf>) -> Builder {
        self.patches.push((name.into(), dir.into()));
        self
    }

    /// The architecture (`sm_70`, `sm_90`), unless `KERNEL_ARCH` overrides
    /// it; default [`DEFAULT_ARCH`](crate::DEFAULT_ARCH).
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
    /// one status line on cargo's terminal ([`notice`](fn@crate::notice)); default yes.
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
        let emit = &mut Directives(out);

        if self.use_env {
            emit.line(format!("rerun-if-env-changed={ENV_ARCH}"));
            emit.line(format!("rerun-if-env-changed={ENV_STUB}"));
        }
        if self.use_env && env.var(ENV_STUB).is_some_and(|v| v == "1") {
            write_stub(emit, &lib, &dest, self.export_arch.as_deref())?;
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
            emit.line(format!("rerun-if-env-changed={ENV_PTX_ISA}"));
        }
        emit.line(format!("rerun-if-changed={}", manifest.display()));
        if manifest_dir.join("build.rs").is_file() {
            emit.line("rerun-if-changed=build.rs".into());
        }

        let knobs = Knobs::resolve(
            self.arch.as_deref(),
            self.ptx_isa.as_deref(),
            self.use_env,
            env,
        )?;
        let target_dir = self
            .target_dir
            .clone()
            .unwrap_or_else(|| kernels_target_dir(&out_dir))
            .join(knobs.dir_name());
        let built = nested::build(
            env,
            &krate,
            &target_dir,
            &knobs,
            &lib,
            &self.patches,
            self.announce,
        )?;

        let ptx_path = built.join(format!("{lib}.ptx"));
        let expect = ptx::Expect {
            arch: &knobs.arch,
            entries: &self.expect_entries,
            allow_externs: self.allow_externs,
        };
        let (text, entries) = ptx::read_checked(&ptx_path, &expect)?;
        write_if_changed(&dest, &text)?;

        let (sources, packages) = reruns::dep_info(emit, &built.join(format!("{lib}.d")), &krate)?;
        if let Some(name) = &self.export_arch {
            emit.line(format!("rustc-env={name}={}", knobs.arch));
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

/// Stub mode, for tools that cannot run the nvptx build (Miri runs the
/// CUDA-free parts of a crate): no kernels, and every use of the PTX fails
/// loudly.
fn write_stub(
    emit: &mut Directives<'_>,
    lib: &str,
    dest: &Path,
    export_arch: Option<&str>,
) -> Result<()> {
    emit.line(format!(
        "warning={ENV_STUB}=1: the {lib} kernels were not built; the embedded PTX is empty"
    ));
    let stub = format!("// {ENV_STUB}=1: kernels not built\n");
    write_if_changed(dest, &stub)?;
    if let Some(name) = export_arch {
        emit.line(format!("rustc-env={name}=none"));
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{command::artifact_dir, hint::MissingComponent};

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
