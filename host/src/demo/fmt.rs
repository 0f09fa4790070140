//! How the demonstration words its output: sizes, counts, ratios, and the
//! names of things, which differ between a GPU and the CPU emulation.

use gpufeed::{BackendKind, Device};

/// Bytes, human-readable and binary: `256 MiB`, `1.50 GiB`, `0 B`.
pub fn bytes(n: impl Into<u64>) -> String {
    humansize::format_size(n.into(), humansize::BINARY)
}

/// `bytes` for a `usize`.
pub fn size(n: usize) -> String {
    bytes(n as u64)
}

fn superscript(k: u32) -> String {
    k.to_string()
        .chars()
        .map(|c| match c {
            '0' => '⁰',
            '1' => '¹',
            '2' => '²',
            '3' => '³',
            '4' => '⁴',
            '5' => '⁵',
            '6' => '⁶',
            '7' => '⁷',
            '8' => '⁸',
            '9' => '⁹',
            other => other,
        })
        .collect()
}

/// An element count: `10⁶` and `3×10⁶` for round numbers from a thousand
/// up, the plain number otherwise (`1000003`, `512`).
pub fn count(n: u64) -> String {
    if n < 1000 {
        return n.to_string();
    }
    let (mut d, mut k) = (n, 0u32);
    while d % 10 == 0 {
        d /= 10;
        k += 1;
    }
    match d {
        1 => format!("10{}", superscript(k)),
        2..=9 if k >= 3 => format!("{d}×10{}", superscript(k)),
        _ => n.to_string(),
    }
}

/// `count` for a `usize`.
pub fn elems(n: usize) -> String {
    count(n as u64)
}

/// A duration given in milliseconds: `3.377 ms`, or `12.4 us` below 0.1 ms.
pub fn ms(v: f64) -> String {
    if v < 0.1 {
        format!("{:.1} us", v * 1e3)
    } else {
        format!("{v:.3} ms")
    }
}

/// An axis value with no trailing zeros: `0.01`, `2`, `150`, `2.5`.
pub fn number(v: f64) -> String {
    if v == 0.0 {
        return "0".into();
    }
    let decimals = (2 - v.abs().log10().floor() as i32).clamp(0, 6) as usize;
    let s = format!("{v:.decimals$}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

/// `a / b` as a speed comparison of the first against the second, from
/// their times: `1.19x faster`, `1.19x slower`, `as fast` (within 0.5%).
pub fn faster_or_slower(time_ms: f64, reference_ms: f64) -> String {
    let r = reference_ms / time_ms;
    if !r.is_finite() {
        "not comparable".into()
    } else if (r - 1.0).abs() < 0.005 {
        "as fast".into()
    } else if r > 1.0 {
        format!("{r:.2}x faster")
    } else {
        format!("{:.2}x slower", 1.0 / r)
    }
}

/// The names of things on the backend in use: a GPU driver's calls, or what
/// the CPU emulation does instead.
#[derive(Clone, Copy, Debug)]
pub struct Words {
    pub cpu: bool,
}

impl Words {
    pub fn of(device: &Device) -> Words {
        Words::for_kind(device.kind())
    }

    pub fn for_kind(kind: BackendKind) -> Words {
        Words {
            cpu: kind == BackendKind::Cpu,
        }
    }

    /// The blocking wait the latency part compares awaiting with.
    pub fn thread_wait(self) -> &'static str {
        if self.cpu {
            "thread wait"
        } else {
            "cuEventSynchronize"
        }
    }

    /// The same, in a sentence.
    pub fn thread_wait_long(self) -> &'static str {
        if self.cpu {
            "a blocking wait on the calling thread (Event::synchronize)"
        } else {
            "cuEventSynchronize on the calling thread"
        }
    }

    /// Whose clock timed events read.
    pub fn event_clock(self) -> &'static str {
        if self.cpu {
            "stream worker threads' clock, from events"
        } else {
            "GPU clock, from events"
        }
    }

    /// How a pinned buffer is made and given back.
    pub fn host_alloc(self) -> &'static str {
        if self.cpu {
            "mmap+mlock"
        } else {
            "driver allocation (cuMemHostAlloc)"
        }
    }

    pub fn host_allocs(self) -> &'static str {
        if self.cpu {
            "mmap+mlock calls"
        } else {
            "driver allocations"
        }
    }

    pub fn host_free(self) -> &'static str {
        if self.cpu {
            "munmap"
        } else {
            "driver free (cuMemFreeHost)"
        }
    }

    /// How an existing allocation is pinned and unpinned.
    pub fn register(self) -> &'static str {
        if self.cpu {
            "mlock of an existing Vec"
        } else {
            "register an existing Vec (cuMemHostRegister)"
        }
    }

    pub fn unregister(self) -> &'static str {
        if self.cpu {
            "munlock"
        } else {
            "unregister"
        }
    }

    /// What the kernel is timed against.
    pub fn device_copy(self) -> &'static str {
        if self.cpu {
            "emulated device copy (memcpy)"
        } else {
            "device-to-device copy"
        }
    }

    /// What dominates a run so short that it says little: when either
    /// variant takes less than this many milliseconds, the fixed cost of each
    /// operation (a thread hand-off on the CPU emulation, a launch and an
    /// event on a GPU) outweighs the work.
    pub fn too_small_ms(self) -> f64 {
        if self.cpu {
            0.5
        } else {
            0.05
        }
    }

    pub fn fixed_costs(self) -> &'static str {
        if self.cpu {
            "thread hand-offs"
        } else {
            "launch and event costs"
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts() {
        assert_eq!(count(10_000), "10⁴");
        assert_eq!(count(3_000_000), "3×10⁶");
        assert_eq!(count(1_000_003), "1000003");
        assert_eq!(count(120), "120");
        assert_eq!(count(1_000_000_000), "10⁹");
    }

    #[test]
    fn sizes_and_numbers() {
        assert_eq!(bytes(268_435_456u64), "256 MiB");
        assert_eq!(bytes(0u64), "0 B");
        assert_eq!(number(0.01), "0.01");
        assert_eq!(number(2.0), "2");
        assert_eq!(number(150.0), "150");
        assert_eq!(number(2.5), "2.5");
    }

    #[test]
    fn comparisons() {
        assert_eq!(faster_or_slower(1.0, 1.19), "1.19x faster");
        assert_eq!(faster_or_slower(1.19, 1.0), "1.19x slower");
        assert_eq!(faster_or_slower(1.0, 1.001), "as fast");
    }
}
