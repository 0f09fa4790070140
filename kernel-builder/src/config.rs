//! The knobs of a kernel build: the GPU architecture, the PTX ISA version
//! and the stub mode, from the builder and the environment, and what they
//! turn into (rustc flags, the nested target directory's name).

use crate::{env::Env, error::Error};

/// The environment variable that picks the PTX `.target` (e.g. `sm_90`).
pub const ENV_ARCH: &str = "KERNEL_ARCH";
/// The environment variable that picks the PTX ISA version, as a target
/// feature (e.g. `ptx80`); unset: the lowest the architecture allows.
pub const ENV_PTX_ISA: &str = "KERNEL_PTX_ISA";
/// The environment variable that, set to `1`, skips the kernel build and
/// embeds an empty stub PTX (for tools that can't run the nvptx build, such
/// as Miri).
pub const ENV_STUB: &str = "HOST_PTX_STUB";
/// The architecture when neither the builder nor `KERNEL_ARCH` names one:
/// Volta, which every later GPU can JIT-compile from.
pub const DEFAULT_ARCH: &str = "sm_70";

/// The separator of `CARGO_ENCODED_RUSTFLAGS`.
pub(crate) const FLAG_SEPARATOR: char = '\u{1f}';

/// Where a knob's value came from, for error messages.
pub(crate) const FROM_BUILDER_ARCH: &str = "Builder::arch";
pub(crate) const FROM_BUILDER_ISA: &str = "Builder::ptx_isa";

/// The resolved knobs of one build.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Knobs {
    pub arch: String,
    pub isa: Option<String>,
}

/// Whether `arch` names a GPU architecture the way rustc's `-Ctarget-cpu`
/// and PTX's `.target` do: `sm_` and a number.
pub fn is_gpu_arch(arch: &str) -> bool {
    arch.strip_prefix("sm_")
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// Whether `isa` names a PTX ISA target feature: `ptx` and a number
/// (`ptx60`, `ptx78`, `ptx80`).
pub fn is_ptx_isa(isa: &str) -> bool {
    isa.strip_prefix("ptx")
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

impl Knobs {
    /// The builder's values, overridden by `KERNEL_ARCH` / `KERNEL_PTX_ISA`
    /// when `use_env` and they are set.
    pub fn resolve(
        arch: Option<&str>,
        isa: Option<&str>,
        use_env: bool,
        env: &Env,
    ) -> Result<Knobs, Error> {
        let from_env = |name| if use_env { env.var(name) } else { None };
        let (arch, arch_origin) = match (from_env(ENV_ARCH), arch) {
            (Some(v), _) => (v, ENV_ARCH),
            (None, Some(v)) => (v.to_string(), FROM_BUILDER_ARCH),
            (None, None) => (DEFAULT_ARCH.to_string(), FROM_BUILDER_ARCH),
        };
        if !is_gpu_arch(&arch) {
            return Err(Error::BadArch {
                origin: arch_origin,
                value: arch,
            });
        }
        let (isa, isa_origin) = match (from_env(ENV_PTX_ISA), isa) {
            (Some(v), _) => (Some(v), ENV_PTX_ISA),
            (None, v) => (v.map(str::to_string), FROM_BUILDER_ISA),
        };
        if let Some(isa) = &isa {
            if !is_ptx_isa(isa) {
                return Err(Error::BadPtxIsa {
                    origin: isa_origin,
                    value: isa.clone(),
                });
            }
        }
        Ok(Knobs { arch, isa })
    }

    /// The nested build's rustc flags: the architecture, and the PTX ISA
    /// when one was asked for.
    pub fn rustflags(&self) -> Vec<String> {
        let mut flags = vec![format!("-Ctarget-cpu={}", self.arch)];
        if let Some(isa) = &self.isa {
            flags.push(format!("-Ctarget-feature=+{isa}"));
        }
        flags
    }

    /// [`Knobs::rustflags`] as `CARGO_ENCODED_RUSTFLAGS` wants them.
    pub fn encoded_rustflags(&self) -> String {
        self.rustflags().join(&FLAG_SEPARATOR.to_string())
    }

    /// The nested target directory's name for this flag set (`sm_70`,
    /// `sm_90-ptx80`): one directory per flag set, so switching back and
    /// forth does not rebuild `core` each time.
    pub fn dir_name(&self) -> String {
        let mut name = self.arch.clone();
        if let Some(isa) = &self.isa {
            name.push('-');
            name.extend(
                isa.chars()
                    .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }),
            );
        }
        name
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Env {
        Env::from_pairs(pairs.iter().copied())
    }

    #[test]
    fn architectures_are_sm_and_a_number() {
        for ok in ["sm_70", "sm_90", "sm_120", "sm_5"] {
            assert!(is_gpu_arch(ok), "{ok}");
        }
        for bad in [
            "",
            "sm_",
            "sm70",
            "compute_70",
            "sm_7x",
            "SM_70",
            "sm_-1",
            "sm_ 70",
        ] {
            assert!(!is_gpu_arch(bad), "{bad}");
        }
        assert!(is_ptx_isa("ptx80") && is_ptx_isa("ptx78"));
        for bad in ["", "ptx", "+ptx80", "ptx8.0", "PTX80", "sm_80"] {
            assert!(!is_ptx_isa(bad), "{bad}");
        }
    }

    #[test]
    fn defaults_builder_values_and_environment_overrides() {
        let none = env(&[]);
        let k = Knobs::resolve(None, None, true, &none).unwrap();
        assert_eq!(k.arch, DEFAULT_ARCH);
        assert_eq!(k.isa, None);

        let k = Knobs::resolve(Some("sm_80"), Some("ptx78"), true, &none).unwrap();
        assert_eq!(
            (k.arch.as_str(), k.isa.as_deref()),
            ("sm_80", Some("ptx78"))
        );

        let set = env(&[(ENV_ARCH, "sm_90"), (ENV_PTX_ISA, "ptx80")]);
        let k = Knobs::resolve(Some("sm_80"), Some("ptx78"), true, &set).unwrap();
        assert_eq!(
            (k.arch.as_str(), k.isa.as_deref()),
            ("sm_90", Some("ptx80"))
        );

        // Knobs off: the environment is not read.
        let k = Knobs::resolve(Some("sm_80"), None, false, &set).unwrap();
        assert_eq!((k.arch.as_str(), k.isa.as_deref()), ("sm_80", None));
    }

    #[test]
    fn bad_values_name_where_they_came_from() {
        let set = env(&[(ENV_ARCH, "volta")]);
        let e = Knobs::resolve(None, None, true, &set).unwrap_err();
        assert!(matches!(&e, Error::BadArch { origin: ENV_ARCH, value } if value == "volta"));
        assert!(e.to_string().contains("KERNEL_ARCH=\"volta\""), "{e}");
        assert!(e.to_string().contains("sm_70 or sm_90"), "{e}");

        let e = Knobs::resolve(Some("70"), None, true, &env(&[])).unwrap_err();
        assert!(matches!(
            e,
            Error::BadArch {
                origin: FROM_BUILDER_ARCH,
                ..
            }
        ));

        let set = env(&[(ENV_PTX_ISA, "8.0")]);
        let e = Knobs::resolve(None, None, true, &set).unwrap_err();
        assert!(
            matches!(
                e,
                Error::BadPtxIsa {
                    origin: ENV_PTX_ISA,
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn flags_are_encoded_with_the_unit_separator() {
        let k = Knobs {
            arch: "sm_90".into(),
            isa: Some("ptx80".into()),
        };
        assert_eq!(
            k.rustflags(),
            ["-Ctarget-cpu=sm_90", "-Ctarget-feature=+ptx80"]
        );
        assert_eq!(
            k.encoded_rustflags(),
            "-Ctarget-cpu=sm_90\u{1f}-Ctarget-feature=+ptx80"
        );
        assert_eq!(k.dir_name(), "sm_90-ptx80");
        let k = Knobs {
            arch: "sm_70".into(),
            isa: None,
        };
        assert_eq!(k.encoded_rustflags(), "-Ctarget-cpu=sm_70");
        assert_eq!(k.dir_name(), "sm_70");
    }
}
