//! The random data of the checked rounds: a fresh pattern per round, a key
//! per buffer, and the scribble that makes a copy that did not happen show.

/// Every byte of the test data has its lowest bit set: random, never zero.
/// A buffer's data is a fresh random pattern (one per checked round) XORed
/// with a random key of its own whose bytes have that bit clear, so buffers
/// differ from each other and a copy into the wrong buffer shows.
const NONZERO: u64 = 0x0101_0101_0101_0101;
/// What a destination is overwritten with before a checked copy into it:
/// keeps every byte nonzero and makes every byte differ from the data.
const SCRIBBLE: u64 = 0x0202_0202_0202_0202;

/// The random data of a checked round: a pattern of one buffer's length,
/// and the keys that make each buffer's copy of it its own.
pub(super) struct Data {
    pub(super) pattern: Vec<u64>,
    rng: fastrand::Rng,
}

impl Data {
    pub(super) fn new(words: usize, seed: u64) -> Data {
        Data {
            pattern: vec![0; words],
            rng: fastrand::Rng::with_seed(seed),
        }
    }

    /// A fresh pattern, every byte with its lowest bit set.
    pub(super) fn fresh(&mut self) {
        for x in &mut self.pattern {
            *x = self.rng.u64(..) | NONZERO;
        }
    }

    /// A fresh key: random, every byte's lowest bit clear.
    pub(super) fn key(&mut self) -> u64 {
        self.rng.u64(..) & !NONZERO
    }
}

/// Fills `v` with the pattern under `key`: every byte nonzero.
pub(super) fn fill(v: &mut [u64], pattern: &[u64], key: u64) {
    for (x, p) in v.iter_mut().zip(pattern) {
        *x = p ^ key;
    }
}

/// Whether `v` holds exactly what `fill(_, pattern, key)` writes.
pub(super) fn holds(v: &[u64], pattern: &[u64], key: u64) -> bool {
    v.len() == pattern.len() && v.iter().zip(pattern).all(|(x, p)| *x == p ^ key)
}

pub(super) fn scribble(v: &mut [u64]) {
    for x in v {
        *x ^= SCRIBBLE;
    }
}
