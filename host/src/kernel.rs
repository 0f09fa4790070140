//! Typed kernel calls and launch configuration.
//!
//! A [`KernelCall`] names a kernel of `gpu-kernels` with arguments of the right
//! types; the CUDA backend packs them as `cuLaunchKernel` parameters in the
//! order the `extern "ptx-kernel"` signatures declare, the CPU backend runs
//! the same per-element bodies on its threads.

/// Threads per block for the elementwise kernels.
pub const BLOCK: u32 = 256;
/// Resident blocks per multiprocessor we aim for (2048 threads / 256).
pub const BLOCKS_PER_SM: u32 = 8;

/// A kernel with its arguments. Device addresses are raw here; the safe
/// layer (`Commands`) builds these from borrowed device buffers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KernelCall {
    /// `x[i] *= s`.
    Scale {
        /// Device address of `n` floats.
        x: u64,
        /// Element count.
        n: usize,
        /// Factor.
        s: f32,
    },
    /// `y[i] = a * x[i] + y[i]`.
    Saxpy {
        /// Multiplier.
        a: f32,
        /// Device address of `n` floats (read).
        x: u64,
        /// Device address of `n` floats (read and written).
        y: u64,
        /// Element count.
        n: usize,
    },
    /// `k` dependent FMAs on each `x[i]`.
    Intensity {
        /// Device address of `n` floats.
        x: u64,
        /// Element count.
        n: usize,
        /// FMAs per element.
        k: u32,
    },
    /// Spins until the `u32` at device-mapped address `flag` is non-zero.
    #[cfg_attr(not(feature = "hooks"), allow(dead_code))]
    GateWait {
        /// Device address of the flag.
        flag: u64,
    },
    /// Faults on purpose.
    #[cfg_attr(not(feature = "hooks"), allow(dead_code))]
    Trap,
}

impl KernelCall {
    /// The entry point's name in the PTX.
    pub fn name(&self) -> &'static str {
        match self {
            KernelCall::Scale { .. } => "scale",
            KernelCall::Saxpy { .. } => "saxpy",
            KernelCall::Intensity { .. } => "intensity",
            KernelCall::GateWait { .. } => "gate_wait",
            KernelCall::Trap => "trap",
        }
    }

    /// Elements processed (0 for control kernels).
    pub fn len(&self) -> usize {
        match *self {
            KernelCall::Scale { n, .. }
            | KernelCall::Saxpy { n, .. }
            | KernelCall::Intensity { n, .. } => n,
            KernelCall::GateWait { .. } | KernelCall::Trap => 0,
        }
    }

    /// The grid that fills `sm_count` multiprocessors without more blocks than
    /// the 16-byte vectors need (the kernels are grid-stride loops).
    pub fn grid(&self, sm_count: u32) -> (u32, u32) {
        match self {
            KernelCall::GateWait { .. } | KernelCall::Trap => (1, 1),
            _ => {
                let vectors = self.len().div_ceil(4) as u64;
                let needed = vectors.div_ceil(BLOCK as u64).max(1);
                let full = (sm_count.max(1) * BLOCKS_PER_SM) as u64;
                (needed.min(full) as u32, BLOCK)
            }
        }
    }
}

/// A kernel to apply in a pipeline or a job, without addresses.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
#[serde(tag = "kernel", rename_all = "lowercase")]
pub enum Kernel {
    /// `x *= s`.
    Scale {
        /// Factor.
        s: f32,
    },
    /// `k` dependent FMAs per element (2k flop per 8 bytes moved).
    Intensity {
        /// FMAs per element.
        k: u32,
    },
}

impl Kernel {
    /// The call on `n` floats at device address `x`.
    pub(crate) fn call(&self, x: u64, n: usize) -> KernelCall {
        match *self {
            Kernel::Scale { s } => KernelCall::Scale { x, n, s },
            Kernel::Intensity { k } => KernelCall::Intensity { x, n, k },
        }
    }

    /// The CPU reference of one element.
    pub fn reference(&self, v: f32) -> f32 {
        match *self {
            Kernel::Scale { s } => gpu_kernels::elementwise::scale(v, s),
            Kernel::Intensity { k } => gpu_kernels::elementwise::intensity(v, k),
        }
    }

    /// A short label, e.g. `scale` or `intensity(k=64)`.
    pub fn label(&self) -> String {
        match self {
            Kernel::Scale { .. } => "scale".into(),
            Kernel::Intensity { k } => format!("intensity(k={k})"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_fills_the_device_but_no_more_than_needed() {
        let big = KernelCall::Scale {
            x: 0,
            n: 1 << 30,
            s: 1.0,
        };
        assert_eq!(big.grid(132), (132 * BLOCKS_PER_SM, BLOCK));
        let small = KernelCall::Scale { x: 0, n: 5, s: 1.0 };
        assert_eq!(small.grid(132), (1, BLOCK));
        assert_eq!(KernelCall::Trap.grid(132), (1, 1));
    }
}
