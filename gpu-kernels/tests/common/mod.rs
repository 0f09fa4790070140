//! Helpers of the block-level kernel tests: 16-byte aligned buffers (and
//! deliberately misaligned views of them), a launch on the CPU emulation,
//! and models of `kernel_abi`'s fixed reduction trees (for the bit-exact
//! checks of the kernels that claim a fixed order).
#![allow(dead_code)]

use kernel_abi::thread::{emulate_launch, Launch};
use kernel_abi::Kernel;

/// 16 aligned bytes.
#[repr(C, align(16))]
#[derive(Clone, Copy)]
struct A16([u8; 16]);

/// A buffer of `len` `T`s starting `offset` bytes after a 16-byte boundary.
pub struct Buf<T> {
    raw: Vec<A16>,
    offset: usize,
    len: usize,
    _t: std::marker::PhantomData<T>,
}

impl<T: Copy> Buf<T> {
    /// A buffer of `v`'s elements at byte `offset` (a multiple of `size_of::<T>()`).
    pub fn new(v: &[T], offset: usize) -> Self {
        let bytes = offset + std::mem::size_of_val(v);
        let mut b = Buf {
            raw: vec![A16([0; 16]); bytes.div_ceil(16) + 1],
            offset,
            len: v.len(),
            _t: std::marker::PhantomData,
        };
        b.as_mut().copy_from_slice(v);
        b
    }

    /// The elements.
    pub fn as_mut(&mut self) -> &mut [T] {
        // SAFETY: `raw` holds offset + len * size bytes; `offset` keeps `T`'s alignment.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.raw
                    .as_mut_ptr()
                    .cast::<u8>()
                    .add(self.offset)
                    .cast::<T>(),
                self.len,
            )
        }
    }

    /// A read-only kernel view.
    pub fn slice(&mut self) -> kernel_abi::Slice<T> {
        let s = self.as_mut();
        // SAFETY: the buffer outlives the launches the tests make with it.
        unsafe { kernel_abi::Slice::from_raw_parts(s.as_ptr(), s.len()) }
    }

    /// A writable kernel view.
    pub fn slice_mut(&mut self) -> kernel_abi::SliceMut<T> {
        let s = self.as_mut();
        // SAFETY: as above.
        unsafe { kernel_abi::SliceMut::from_raw_parts(s.as_mut_ptr(), s.len()) }
    }

    /// A copy of the elements.
    pub fn contents(&mut self) -> Vec<T> {
        self.as_mut().to_vec()
    }
}

/// Runs kernel `K` with `params` on the CPU emulation (`workers` OS threads).
pub fn launch<K: Kernel>(launch: Launch, workers: usize, params: K::Params)
where
    K::Params: Sync,
{
    // SAFETY: the tests pass buffers that outlive the launch, with the
    // lengths and the launch the kernels' contracts ask for.
    emulate_launch(K::NAME, &launch, workers, &|| unsafe { K::thread(params) }).unwrap();
}

/// `reduce_to_lane0` of `kernel_abi::warp` over `v` (`v.len()` lanes take
/// part): the `shfl_down` tree 16, 8, 4, 2, 1.
pub fn warp_tree(v: &[f32], op: fn(f32, f32) -> f32) -> f32 {
    let mut a = v.to_vec();
    let width = a.len();
    a.resize(32, f32::NAN);
    let mut off = 16;
    while off > 0 {
        let old = a.clone();
        for l in 0..32 {
            if l + off < width {
                a[l] = op(old[l], old[l + off]);
            }
        }
        off /= 2;
    }
    a[0]
}

/// `kernel_abi::block::reduce` over a block's thread values (a multiple of 32).
pub fn block_tree(v: &[f32], op: fn(f32, f32) -> f32) -> f32 {
    let slots: Vec<f32> = v.chunks(32).map(|w| warp_tree(w, op)).collect();
    warp_tree(&slots, op)
}

/// Random `f32` in `[-1, 1)`.
pub fn uniform(rng: &mut fastrand::Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.f32() * 2.0 - 1.0).collect()
}

/// The sizes every test covers.
pub const SIZES: [usize; 6] = [0, 1, 31, 33, 1000, 1_000_007];

/// Unit roundoff of `f32`.
pub const U: f64 = 1.0 / (1u64 << 24) as f64;
