//! Fix-it hints for a failed nested build: the usual failures of a machine
//! that lacks a rustup component.

/// A rustup component the nested build's error output points at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MissingComponent {
    /// `rust-src`: needed by `-Zbuild-std=core` (there is no prebuilt `core`
    /// for nvptx64 to download).
    RustSrc,
    /// `llvm-bitcode-linker`: the nvptx64 "linker" that writes the PTX.
    LlvmBitcodeLinker,
    /// `llvm-tools`: the bitcode linker runs `llvm-link`, `opt` and `llc`
    /// from it.
    LlvmTools,
    /// Nothing recognised: the error is the kernel crate's own, most likely.
    Unknown,
}

const INSTALL: &str =
    "run `rustup toolchain install` where rust-toolchain.toml lists the components \
    the kernel build needs (rust-src, llvm-bitcode-linker, llvm-tools), or `rustup component add \
    rust-src llvm-bitcode-linker llvm-tools`";

impl MissingComponent {
    /// Reads the nested build's standard error.
    ///
    /// The bitcode linker's own failures come first: when `llvm-tools` is
    /// missing, the error names the linker (`linking with
    /// llvm-bitcode-linker failed`) but the cause is `llvm-link failed`.
    pub fn diagnose(stderr: &str) -> MissingComponent {
        if stderr.contains("rust-src") || stderr.contains("can't find crate for `core`") {
            MissingComponent::RustSrc
        } else if stderr.contains("llvm-link")
            || stderr.contains("llc failed")
            || stderr.contains("opt failed")
        {
            MissingComponent::LlvmTools
        } else if stderr.contains("linker `rust-ptx-linker`")
            || stderr.contains("llvm-bitcode-linker")
            || (stderr.contains("linker") && stderr.contains("not found"))
        {
            MissingComponent::LlvmBitcodeLinker
        } else {
            MissingComponent::Unknown
        }
    }

    /// The rustup component's name, when one was recognised.
    pub fn component(&self) -> Option<&'static str> {
        match self {
            MissingComponent::RustSrc => Some("rust-src"),
            MissingComponent::LlvmBitcodeLinker => Some("llvm-bitcode-linker"),
            MissingComponent::LlvmTools => Some("llvm-tools"),
            MissingComponent::Unknown => None,
        }
    }

    /// The hint printed under the nested build's errors.
    pub fn hint(&self) -> String {
        match self {
            MissingComponent::RustSrc => format!(
                "hint: the `rust-src` component is missing (needed by -Zbuild-std=core); {INSTALL}"
            ),
            MissingComponent::LlvmBitcodeLinker => {
                format!("hint: the `llvm-bitcode-linker` component is missing; {INSTALL}")
            }
            MissingComponent::LlvmTools => format!(
                "hint: the `llvm-tools` component is missing (the bitcode linker runs llvm-link, \
                 opt and llc from it); {INSTALL}"
            ),
            MissingComponent::Unknown => {
                format!("hint: if a toolchain component is missing, {INSTALL}")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recognises_each_missing_component() {
        // What rustc and the bitcode linker print on a machine without them.
        let cases = [
            ("error: \"/x/lib/rustlib/src/rust/library/Cargo.lock\" does not exist, unable to build with the standard library, try:\n        rustup component add rust-src --toolchain 1.95.0", MissingComponent::RustSrc),
            ("error[E0463]: can't find crate for `core`", MissingComponent::RustSrc),
            ("error: linker `rust-ptx-linker` not found", MissingComponent::LlvmBitcodeLinker),
            ("error: linker `llvm-bitcode-linker` not found\n  = note: No such file or directory", MissingComponent::LlvmBitcodeLinker),
            ("error: linking with `/x/llvm-bitcode-linker` failed: exit status: 1\n  = note: Error: llvm-link failed to link files", MissingComponent::LlvmTools),
            ("Error: llvm-link failed to link files", MissingComponent::LlvmTools),
            ("Error: llc failed", MissingComponent::LlvmTools),
            ("Error: opt failed", MissingComponent::LlvmTools),
            ("error[E0425]: cannot find value `y` in this scope", MissingComponent::Unknown),
        ];
        for (stderr, want) in cases {
            assert_eq!(MissingComponent::diagnose(stderr), want, "{stderr}");
        }
    }

    #[test]
    fn hints_name_the_component_and_the_fix() {
        for c in [
            MissingComponent::RustSrc,
            MissingComponent::LlvmBitcodeLinker,
            MissingComponent::LlvmTools,
        ] {
            let h = c.hint();
            assert!(h.contains(c.component().unwrap()), "{h}");
            assert!(h.contains("rustup toolchain install"), "{h}");
            assert!(h.contains("rustup component add"), "{h}");
        }
        assert_eq!(MissingComponent::Unknown.component(), None);
        assert!(MissingComponent::Unknown
            .hint()
            .contains("if a toolchain component is missing"));
    }
}
