//! The tensor-core bf16 GEMM on the CPU emulation (its `mma`, `ldmatrix`
//! and `cp.async` emulated), launched with its plan fn: every element
//! bit-identical to a sequential fma loop over the bf16 values (the
//! emulation's order; the GPU's `mma` order is unspecified) and within the
//! documented bound of an `f64` reference (which holds on the GPU too), at
//! shapes that are and are not multiples of the 128x128x32 tile, with
//! `beta == 0` on a NaN-poisoned `C` and with `beta != 0`, on aligned
//! slices (`cp.async`) and misaligned ones (the element gather).

use gpu_kernels::gemm_mma::{bf16_to_f32, DYNAMIC_SHARED_BYTES};
use gpu_kernels::{gemm_bf16, gemm_bf16_launch};
use kernel_abi::thread::{emulate_launch, EmulationError, FaultKind};
use kernel_abi::{Kernel, Slice, SliceMut};

/// A 16-byte aligned allocation.
#[derive(Clone, Copy)]
#[repr(C, align(16))]
struct A16([u8; 16]);

/// `len` values of `T` starting `offset` elements into a 16-byte aligned
/// buffer.
struct Buf<T> {
    store: Vec<A16>,
    offset: usize,
    len: usize,
    _t: std::marker::PhantomData<T>,
}

impl<T: Copy> Buf<T> {
    fn new(values: &[T], offset: usize) -> Buf<T> {
        let bytes = (values.len() + offset) * size_of::<T>();
        let mut b = Buf {
            store: vec![A16([0xff; 16]); bytes.div_ceil(16).max(1)],
            offset,
            len: values.len(),
            _t: std::marker::PhantomData,
        };
        // SAFETY: the `len` elements from `offset` lie in the allocation.
        let dst = unsafe { std::slice::from_raw_parts_mut(b.as_mut_ptr(), b.len) };
        dst.copy_from_slice(values);
        b
    }
    fn as_mut_ptr(&mut self) -> *mut T {
        // SAFETY: offset is inside the allocation.
        unsafe { self.store.as_mut_ptr().cast::<T>().add(self.offset) }
    }
    fn values(&self) -> &[T] {
        // SAFETY: the `len` elements from `offset` lie in the allocation.
        unsafe {
            std::slice::from_raw_parts(self.store.as_ptr().cast::<T>().add(self.offset), self.len)
        }
    }
}

/// Random bf16 bits of values in [-1, 1).
fn random_bf16(rng: &mut fastrand::Rng, n: usize) -> Vec<u16> {
    (0..n)
        .map(|_| ((rng.f32() * 2.0 - 1.0).to_bits() >> 16) as u16)
        .collect()
}

#[allow(clippy::too_many_arguments)]
fn emulate(
    (m, n, k): (usize, usize, usize),
    alpha: f32,
    a: &mut Buf<u16>,
    b: &mut Buf<u16>,
    beta: f32,
    c: &mut Buf<f32>,
) -> Result<(), EmulationError> {
    let launch = gemm_bf16_launch(m as u32, n as u32, k as u32);
    // SAFETY: the buffers outlive the launch; `c` is disjoint from both.
    let params = unsafe {
        (
            m as u32,
            n as u32,
            k as u32,
            alpha,
            Slice::from_raw_parts(a.as_mut_ptr().cast_const(), a.len),
            Slice::from_raw_parts(b.as_mut_ptr().cast_const(), b.len),
            beta,
            SliceMut::from_raw_parts(c.as_mut_ptr(), c.len),
        )
    };
    // SAFETY: the slices are valid for their lengths; the plan's launch.
    emulate_launch("gemm_bf16", &launch, 2, &|| unsafe {
        <gemm_bf16 as Kernel>::thread(params)
    })
}

fn check_shape(
    rng: &mut fastrand::Rng,
    (m, n, k): (usize, usize, usize),
    beta: f32,
    offset: usize,
) {
    let alpha = if rng.bool() {
        1.0
    } else {
        rng.f32() * 4.0 - 2.0
    };
    let (av, bv) = (random_bf16(rng, m * k), random_bf16(rng, k * n));
    let c_old: Vec<f32> = if beta == 0.0 {
        vec![f32::NAN; m * n]
    } else {
        (0..m * n).map(|_| rng.f32() * 2.0 - 1.0).collect()
    };
    let (mut a, mut b, mut c) = (
        Buf::new(&av, offset),
        Buf::new(&bv, offset),
        Buf::new(&c_old, offset),
    );
    emulate((m, n, k), alpha, &mut a, &mut b, beta, &mut c).unwrap();
    let (af, bf): (Vec<f32>, Vec<f32>) = (
        av.iter().map(|&x| bf16_to_f32(x)).collect(),
        bv.iter().map(|&x| bf16_to_f32(x)).collect(),
    );
    let what = format!("{m}x{n}x{k} alpha {alpha} beta {beta} offset {offset}");
    // The emulation's order: the sgemm reference's (sequential fma, k up).
    let mut want = c_old.clone();
    gpu_kernels::gemm::sgemm_reference(m, n, k, alpha, &af, &bf, beta, &mut want);
    let got = c.values();
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(
            g.to_bits(),
            w.to_bits(),
            "{what}: element {i}: got {g}, sequential {w}"
        );
    }
    // The documented bound (2u a step: holds for a tensor core that
    // rounds its additions toward zero).
    let u = f64::from(f32::EPSILON);
    let kk = (k + 2) as f64;
    let gamma = kk * u / (1.0 - kk * u);
    for i in 0..m {
        for j in 0..n {
            let (mut s, mut abs) = (0.0f64, 0.0f64);
            for p in 0..k {
                let t = f64::from(af[i * k + p]) * f64::from(bf[p * n + j]);
                s += t;
                abs += t.abs();
            }
            let old = if beta == 0.0 {
                0.0
            } else {
                f64::from(c_old[i * n + j])
            };
            let exact = f64::from(alpha) * s + f64::from(beta) * old;
            let scale = f64::from(alpha).abs() * abs + (f64::from(beta) * old).abs();
            let bound = gamma * scale * (1.0 + 1e-6) + f64::from(f32::MIN_POSITIVE);
            let g = f64::from(got[i * n + j]);
            assert!(
                (g - exact).abs() <= bound,
                "{what}: ({i}, {j}) got {g}, f64 {exact}, bound {bound}"
            );
        }
    }
}

#[test]
fn gemm_bf16_with_beta_zero_matches_the_sequential_fma_loop_on_the_emulation_and_never_reads_c() {
    let mut rng = fastrand::Rng::with_seed(0xbf_0001);
    for shape in [(1, 1, 1), (31, 33, 17), (64, 64, 64), (129, 257, 65)] {
        check_shape(&mut rng, shape, 0.0, 0);
    }
}

#[test]
fn gemm_bf16_with_beta_nonzero_matches_the_sequential_fma_loop_on_the_emulation() {
    let mut rng = fastrand::Rng::with_seed(0xbf_0002);
    for shape in [(31, 33, 17), (200, 100, 300)] {
        check_shape(&mut rng, shape, -0.75, 0);
    }
}

#[test]
fn gemm_bf16_on_misaligned_slices_gathers_the_tiles_with_the_same_results() {
    let mut rng = fastrand::Rng::with_seed(0xbf_0003);
    // Multiples of 8 (the cp.async condition) but not 16-byte aligned.
    check_shape(&mut rng, (40, 136, 48), 0.0, 1);
}

#[test]
fn gemm_bf16_at_tile_multiples_uses_every_pipeline_stage() {
    let mut rng = fastrand::Rng::with_seed(0xbf_0004);
    check_shape(&mut rng, (128, 256, 160), 1.0, 0);
}

#[test]
fn gemm_bf16_with_k_zero_sets_c_to_beta_times_c_and_m_zero_writes_nothing() {
    for beta in [0.0f32, -2.5] {
        let c_old: Vec<f32> = (0..35).map(|i| i as f32 - 17.5).collect();
        let (mut a, mut b, mut c) = (Buf::new(&[], 0), Buf::new(&[], 0), Buf::new(&c_old, 0));
        emulate((5, 7, 0), 3.0, &mut a, &mut b, beta, &mut c).unwrap();
        for (g, o) in c.values().iter().zip(&c_old) {
            let want = if beta == 0.0 { 0.0 } else { beta * o };
            assert_eq!(g.to_bits(), want.to_bits(), "beta {beta}");
        }
    }
    let (mut a, mut b, mut c) = (
        Buf::new(&[], 0),
        Buf::new(&[1u16; 12], 0),
        Buf::new(&[7.0f32; 4], 0),
    );
    c.len = 0;
    emulate((0, 4, 3), 1.0, &mut a, &mut b, 0.0, &mut c).unwrap();
    c.len = 4;
    assert_eq!(c.values(), &[7.0; 4]);
}

#[test]
fn gemm_bf16_traps_on_a_short_slice_or_too_little_dynamic_shared_memory() {
    let (mut a, mut b, mut c) = (
        Buf::new(&[0u16; 5], 0),
        Buf::new(&[0u16; 6], 0),
        Buf::new(&[0f32; 4], 0),
    );
    let e = emulate((2, 2, 3), 1.0, &mut a, &mut b, 0.0, &mut c).unwrap_err();
    assert_eq!(e.kind, FaultKind::Trap, "{e}");
    let mut launch = gemm_bf16_launch(2, 2, 2);
    launch.dynamic_shared_bytes -= 16;
    // SAFETY: unused buffers of the right sizes.
    let params = unsafe {
        (
            2u32,
            2u32,
            2u32,
            1.0f32,
            Slice::from_raw_parts(a.as_mut_ptr().cast_const(), 4),
            Slice::from_raw_parts(b.as_mut_ptr().cast_const(), 4),
            0.0f32,
            SliceMut::from_raw_parts(c.as_mut_ptr(), 4),
        )
    };
    // SAFETY: as above.
    let e = emulate_launch("gemm_bf16", &launch, 1, &|| unsafe {
        <gemm_bf16 as Kernel>::thread(params)
    })
    .unwrap_err();
    assert_eq!(e.kind, FaultKind::Trap, "{e}");
}

#[test]
fn gemm_bf16_launch_plans_128_threads_and_48_kib_per_128x128_tile() {
    let l = gemm_bf16_launch(129, 257, 65);
    assert_eq!((l.grid.x, l.grid.y, l.grid.z), (6, 1, 1));
    assert_eq!((l.block.x, l.block.y, l.block.z), (128, 1, 1));
    assert_eq!(l.dynamic_shared_bytes, DYNAMIC_SHARED_BYTES);
    assert_eq!(DYNAMIC_SHARED_BYTES, 48 * 1024);
    assert_eq!(gemm_bf16_launch(0, 5, 5).grid.x, 1);
}
