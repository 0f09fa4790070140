//! How a run is cut: the [`Plan`] (chunk count, [`Layout`] over streams,
//! ramped sizes), the chunk ranges it gives an array, and the automatic plan.

use crate::base::error::{Error, Result};

/// How a run is cut: how many chunks, how they are laid over streams, and
/// whether their sizes ramp.
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{Layout, Plan};
/// let plan = Plan::auto(10_000_000); // sqrt(40 MB / 320 KiB) chunks, engine streams
/// assert_eq!((plan.chunks, plan.layout), (11, Layout::Engines { slots: 4 }));
/// assert_eq!(Plan::auto_for(10_000_000, 2), Plan::uniform(11, 2)); // for 2 streams
/// let plan = Plan::uniform(4, 2).chained();
/// assert_eq!(plan.to_string(), "4 chunks x 2 streams, chained");
/// assert_eq!(plan.ranges(1000)[3], 768..1000); // multiples of 64 elements but the last
/// let err = Plan::uniform(0, 2).validate(1000).unwrap_err();
/// assert!(matches!(err, gpufeed::Error::InvalidArgument(_)));
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    /// Chunks the arrays are cut into, at most. A plan is reduced, never
    /// refused, for the data it meets: `n` elements are cut into chunks of
    /// `ceil(n / chunks)` elements rounded up to a multiple of 64 (the
    /// granularity: 256 bytes of `f32`), the last one shorter, so
    /// `ceil(n / that)` chunks run, each holding at least one element (an
    /// empty run none). 100 chunks over 10 elements run as 1;
    /// `Plan::uniform(7, 4)` over 1,000 elements runs 6 chunks of 192 (the
    /// last of 40). [`RunInfo::chunks`](super::RunInfo::chunks) says how many ran, and
    /// [`Plan::ranges`] gives them beforehand. A plan is refused
    /// ([`Error::InvalidArgument`], [`Plan::validate`]) only for 0 chunks
    /// or 0 streams (slots).
    ///
    /// ```
    /// use gpufeed::Plan;
    /// let plan = Plan::uniform(7, 4);
    /// let lens: Vec<usize> = plan.ranges(1000).iter().map(|r| r.len()).collect();
    /// assert_eq!(lens, [192, 192, 192, 192, 192, 40]);
    /// assert_eq!(Plan::uniform(100, 4).ranges(10), [0..10]);
    /// assert!(Plan::uniform(7, 4).ranges(0).is_empty());
    /// assert!(Plan::uniform(0, 4).validate(1000).is_err());
    /// ```
    pub chunks: usize,
    /// How the chunks go over the pipeline's streams.
    pub layout: Layout,
    /// Ramp the chunk sizes: the first three chunks are 1/8, 1/4 and 1/2 of
    /// the others, and the last three mirror them. The pipeline's fill (the
    /// first H2D, which nothing overlaps) and drain (the last D2H) shrink
    /// eightfold, while the middle chunks stay large enough for full-speed
    /// copies. The chunk count then counts the full-size chunks. An array
    /// shorter than the six ramp pieces and one full chunk runs unramped.
    pub ramp: bool,
}

/// How a run's chunks go over the pipeline's streams.
///
/// ```rust
/// use gpufeed::{Layout, Plan};
/// let plan = Plan::uniform(8, 4);
/// assert_eq!(plan.layout, Layout::RoundRobin { streams: 4, chain: false });
/// assert_eq!(plan.layout.name(), "round-robin");
/// let engines = Plan::engines(8, 3); // 3 sets of device buffers in flight
/// assert_eq!(engines.layout.name(), "engines");
/// assert_eq!(engines.streams_used(), 3); // copy-in, compute, copy-out
/// let layout = Layout::RoundRobin { streams: 2, chain: true };
/// let own = Plan { chunks: 16, layout, ramp: false };
/// assert_eq!(own, Plan::uniform(16, 2).chained());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Chunk `i` goes to stream `i % streams`, which copies it in, runs the
    /// stage and copies it out; each stream has one set of device buffers.
    RoundRobin {
        /// Streams the chunks are dealt to (at most the pipeline's).
        streams: usize,
        /// Chain the host-to-device copies across streams: each waits for
        /// the previous chunk's copy, so the first chunk arrives at full link
        /// speed instead of sharing it with the next ones, and its stage and
        /// D2H start sooner (a shorter fill), at the price of an event per
        /// chunk.
        chain: bool,
    },
    /// One stream per engine (module docs): copy-in, compute and copy-out
    /// streams linked by events (the pipeline needs three streams), over a
    /// ring of `slots` sets of device buffers, i.e. chunks in flight.
    Engines {
        /// Sets of device buffers in the ring.
        slots: usize,
    },
}

#[cfg(feature = "serde")]
impl serde::Serialize for Plan {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut st = s.serialize_struct("Plan", 6)?;
        st.serialize_field("chunks", &self.chunks)?;
        st.serialize_field("layout", self.layout.name())?;
        st.serialize_field("streams", &self.streams_used())?;
        st.serialize_field("buffers", &self.slots())?;
        st.serialize_field("ramp", &self.ramp)?;
        st.serialize_field(
            "chain",
            &matches!(self.layout, Layout::RoundRobin { chain: true, .. }),
        )?;
        st.end()
    }
}

impl Layout {
    /// `round-robin` or `engines`.
    pub fn name(&self) -> &'static str {
        match self {
            Layout::RoundRobin { .. } => "round-robin",
            Layout::Engines { .. } => "engines",
        }
    }
}

/// What one more chunk costs, in bytes of copy time: each copy has a fixed
/// cost of about 7 us per direction (on the H200, 40 MB both ways took
/// 0.822 ms as whole copies, 0.892 ms in 8 pieces and 0.934 ms in 16), which
/// the link would have spent moving about 320 KiB.
pub const AUTO_CHUNK_COST_BYTES: usize = 320 << 10;

impl Plan {
    /// A near-optimal plan for `n` floats: the engines layout (it needs a
    /// pipeline of at least three streams) with `k = sqrt(bytes /
    /// AUTO_CHUNK_COST_BYTES)` chunks. More chunks add a fixed cost each
    /// ([`AUTO_CHUNK_COST_BYTES`]); fewer make the one chunk nothing overlaps
    /// (the fill, about `bytes / k`) longer; `k c + bytes / k` is least at
    /// that `k`. About 11 chunks for 10^7 floats, 35 for 10^8, 110 for 10^9;
    /// one chunk on one stream under about 1.5 MB.
    pub fn auto(n: usize) -> Plan {
        let bytes = n.saturating_mul(4) as f64;
        let k = (bytes / AUTO_CHUNK_COST_BYTES as f64).sqrt().round() as usize;
        let k = k.clamp(1, 256).min(n.max(1));
        if k < 2 {
            return Plan::uniform(1, 1);
        }
        Plan::engines(k, 4)
    }

    /// [`Plan::auto`] fitted to a pipeline of `streams` streams: the engines
    /// layout needs three; with fewer, the same chunks go round robin over
    /// the streams there are.
    pub fn auto_for(n: usize, streams: usize) -> Plan {
        let plan = Plan::auto(n);
        match plan.layout {
            Layout::Engines { .. } if streams < 3 => Plan::uniform(plan.chunks, streams.max(1)),
            _ => plan,
        }
    }

    /// `chunks` equal chunks dealt round robin over `streams` streams.
    pub fn uniform(chunks: usize, streams: usize) -> Plan {
        Plan {
            chunks,
            layout: Layout::RoundRobin {
                streams,
                chain: false,
            },
            ramp: false,
        }
    }

    /// The engines layout: `chunks` chunks, `slots` sets of device buffers.
    pub fn engines(chunks: usize, slots: usize) -> Plan {
        Plan {
            chunks,
            layout: Layout::Engines { slots },
            ramp: false,
        }
    }

    /// The same plan with ramped chunk sizes (see [`Plan::ramp`]).
    pub fn ramped(self) -> Plan {
        Plan { ramp: true, ..self }
    }

    /// The same plan with chained host-to-device copies (round robin only;
    /// an engines plan already copies in on one stream, so it is unchanged).
    pub fn chained(self) -> Plan {
        match self.layout {
            Layout::RoundRobin { streams, .. } => Plan {
                layout: Layout::RoundRobin {
                    streams,
                    chain: true,
                },
                ..self
            },
            Layout::Engines { .. } => self,
        }
    }

    /// Streams a run of this plan uses.
    pub fn streams_used(&self) -> usize {
        match self.layout {
            Layout::RoundRobin { streams, .. } => streams,
            Layout::Engines { .. } => 3,
        }
    }

    /// Sets of device chunk buffers a run uses: chunks in flight.
    pub fn slots(&self) -> usize {
        match self.layout {
            Layout::RoundRobin { streams, .. } => streams,
            Layout::Engines { slots } => slots,
        }
    }

    /// The element ranges of the chunks of `n` elements, in issue order.
    /// Chunks are multiples of 64 elements (256 bytes), except the last.
    pub fn ranges(&self, n: usize) -> Vec<std::ops::Range<usize>> {
        let m = self.chunk_len(n);
        let ramp: Vec<usize> = [m / 8, m / 4, m / 2]
            .iter()
            .map(|l| (l / 64 * 64).max(64))
            .collect();
        let ramp_total = ramp
            .iter()
            .fold(0usize, |a, &b| a.saturating_add(b))
            .saturating_mul(2);
        let sizes: Vec<usize> = if !self.ramp || n < ramp_total.saturating_add(m) {
            // Only the chunks that hold an element (none is empty): a count
            // far above `n` (any usize is a valid plan) costs nothing.
            (0..self.chunks.min(n.div_ceil(m.max(1))))
                .map(|i| self.chunk(i, n).len())
                .collect()
        } else {
            let middle = n - ramp_total;
            let mut v = ramp.clone();
            v.extend(std::iter::repeat_n(m, middle / m));
            if !middle.is_multiple_of(m) {
                v.push(middle % m);
            }
            v.extend(ramp.iter().rev());
            v
        };
        let mut start = 0;
        sizes
            .into_iter()
            .map(|l| {
                let r = start..start + l;
                start += l;
                r
            })
            .collect()
    }

    /// Checks the plan for `n` elements: at least one chunk and one stream
    /// or buffer slot. Any `n` is fine, even below the chunk count: short
    /// arrays run in fewer chunks ([`RunInfo::chunks`](super::RunInfo::chunks)).
    pub fn validate(&self, _n: usize) -> Result<()> {
        if self.chunks == 0 || self.slots() == 0 {
            return Err(Error::InvalidArgument(format!(
                "a plan needs at least one chunk and one {} (got {} chunks, {})",
                match self.layout {
                    Layout::RoundRobin { .. } => "stream",
                    Layout::Engines { .. } => "buffer slot",
                },
                self.chunks,
                self.slots()
            )));
        }
        Ok(())
    }

    /// The element range of chunk `i` of `n`: chunks are multiples of 64
    /// elements (256 bytes) except the last.
    pub fn chunk(&self, i: usize, n: usize) -> std::ops::Range<usize> {
        // Saturating: `n` near `usize::MAX` (zero-sized elements) must not
        // overflow.
        let len = self.chunk_len(n);
        let start = i.saturating_mul(len).min(n);
        start..start.saturating_add(len).min(n)
    }

    /// Elements per chunk (the last may be shorter).
    pub fn chunk_len(&self, n: usize) -> usize {
        n.div_ceil(self.chunks.max(1))
            .div_ceil(64)
            .saturating_mul(64)
    }
}

impl std::fmt::Display for Plan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let chunks = if self.chunks == 1 { "chunk" } else { "chunks" };
        match self.layout {
            Layout::Engines { slots } => write!(
                f,
                "{} {chunks}, engine streams, {slots} buffers",
                self.chunks
            )?,
            Layout::RoundRobin { streams, chain } => {
                let s = if streams == 1 { "stream" } else { "streams" };
                write!(f, "{} {chunks} x {streams} {s}", self.chunks)?;
                if chain {
                    write!(f, ", chained")?;
                }
            }
        }
        if self.ramp {
            write!(f, ", ramped")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_cover_every_element_once_in_order() {
        for n in [1usize, 5, 63, 64, 1000, 65_537, 10_000_000] {
            for chunks in [1usize, 3, 8, 32] {
                for ramp in [false, true] {
                    let plan = Plan {
                        ramp,
                        ..Plan::uniform(chunks.min(n), 2)
                    };
                    let r = plan.ranges(n);
                    assert_eq!(r.first().map(|r| r.start), Some(0));
                    assert_eq!(r.last().map(|r| r.end), Some(n));
                    assert!(r.windows(2).all(|w| w[0].end == w[1].start));
                    assert!(r.iter().all(|r| !r.is_empty()), "{plan:?} n={n}");
                }
            }
        }
    }

    #[test]
    fn a_chunk_count_far_above_the_elements_costs_nothing() {
        // 2^62 chunks of 10 elements: one chunk, at once (the loop over
        // every chunk count took ~29 ns a chunk: forever).
        let t = std::time::Instant::now();
        for plan in [Plan::uniform(1 << 62, 4), Plan::engines(1 << 62, 4)] {
            assert_eq!(plan.ranges(10), vec![0..10]);
            assert!(plan.ranges(0).is_empty());
            assert_eq!(plan.ranges(200), vec![0..64, 64..128, 128..192, 192..200]);
        }
        assert!(t.elapsed() < std::time::Duration::from_secs(5));
    }

    #[test]
    fn ramped_plans_start_and_end_small() {
        let n = 10_000_000;
        let r = Plan::uniform(16, 4).ramped().ranges(n);
        let m = Plan::uniform(16, 4).chunk_len(n);
        assert!(r[0].len() <= m / 8 && r[r.len() - 1].len() <= m / 8);
        assert!(r.iter().all(|c| c.len() <= m));
    }

    #[test]
    fn auto_plans_balance_chunk_cost_against_fill() {
        assert_eq!(Plan::auto(1), Plan::uniform(1, 1));
        assert_eq!(Plan::auto(100_000), Plan::uniform(1, 1));
        assert_eq!(Plan::auto(10_000_000), Plan::engines(11, 4));
        assert_eq!(Plan::auto(100_000_000), Plan::engines(35, 4));
        assert_eq!(Plan::auto(1_000_000_000), Plan::engines(110, 4));
        for n in [2usize, 3, 1000, 1 << 20, 12_345_678] {
            assert!(Plan::auto(n).validate(n).is_ok(), "{n}");
        }
    }

    #[test]
    fn plans_say_what_they_are() {
        assert_eq!(Plan::uniform(1, 1).to_string(), "1 chunk x 1 stream");
        assert_eq!(
            Plan::uniform(8, 4).chained().ramped().to_string(),
            "8 chunks x 4 streams, chained, ramped"
        );
        assert_eq!(Plan::engines(5, 2).chained(), Plan::engines(5, 2));
        assert_eq!(Plan::engines(5, 2).streams_used(), 3);
        assert_eq!(Plan::engines(5, 2).slots(), 2);
    }

    #[test]
    fn bad_plans_are_rejected() {
        assert!(Plan::uniform(0, 1).validate(10).is_err());
        assert!(Plan::uniform(1, 0).validate(10).is_err());
        // More chunks than elements: fewer run (`RunInfo::chunks`), as for n = 0.
        assert!(Plan::uniform(11, 1).validate(10).is_ok());
        assert!(Plan::uniform(3, 1).validate(0).is_ok());
        assert!(Plan::uniform(10, 1).validate(10).is_ok());
    }
}
