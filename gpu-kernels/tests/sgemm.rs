//! SGEMM on the CPU emulation, launched with its plan fn: every element
//! bit-identical to the sequential fma-ordered reference and within the
//! documented bound of an `f64` reference, at shapes that are and are not
//! multiples of the 128x128x8 tile, with `beta == 0` on a NaN-poisoned `C`
//! (which must not be read) and with `beta != 0`, on 16-byte aligned
//! slices (the vector paths) and misaligned ones (the element paths).

use gpu_kernels::gemm::{sgemm_reference, BM, BN};
use gpu_kernels::{sgemm, sgemm_launch};
use kernel_abi::thread::{emulate_launch, EmulationError, FaultKind};
use kernel_abi::{Kernel, Slice, SliceMut};

/// A 16-byte aligned allocation of floats.
#[derive(Clone, Copy)]
#[repr(C, align(16))]
struct A16([f32; 4]);

/// `len` floats starting `offset` floats into a 16-byte aligned buffer.
struct Buf {
    store: Vec<A16>,
    offset: usize,
    len: usize,
}

impl Buf {
    fn new(values: &[f32], offset: usize) -> Buf {
        let mut store = vec![A16([f32::NAN; 4]); (values.len() + offset).div_ceil(4).max(1)];
        let mut b = Buf {
            store: Vec::new(),
            offset,
            len: values.len(),
        };
        // SAFETY: A16 is four f32s, no padding.
        let all = unsafe {
            std::slice::from_raw_parts_mut(store.as_mut_ptr().cast::<f32>(), store.len() * 4)
        };
        all[offset..offset + values.len()].copy_from_slice(values);
        b.store = store;
        b
    }
    fn as_mut_ptr(&mut self) -> *mut f32 {
        // SAFETY: offset <= the allocation's floats.
        unsafe { self.store.as_mut_ptr().cast::<f32>().add(self.offset) }
    }
    fn values(&self) -> &[f32] {
        // SAFETY: the `len` floats from `offset` lie in the allocation.
        unsafe {
            std::slice::from_raw_parts(self.store.as_ptr().cast::<f32>().add(self.offset), self.len)
        }
    }
}

fn random(rng: &mut fastrand::Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.f32() * 2.0 - 1.0).collect()
}

/// Runs the kernel on the emulation with `sgemm_launch`'s plan; `c` is
/// updated in place.
#[allow(clippy::too_many_arguments)]
fn emulate_sgemm(
    (m, n, k): (usize, usize, usize),
    alpha: f32,
    a: &mut Buf,
    b: &mut Buf,
    beta: f32,
    c: &mut Buf,
) -> Result<(), EmulationError> {
    let launch = sgemm_launch(m as u32, n as u32, k as u32);
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
    emulate_launch("sgemm", &launch, 2, &|| unsafe {
        <sgemm as Kernel>::thread(params)
    })
}

/// `|got - exact| <= gamma_(k+2) * (|alpha| * sum |a*b| + |beta * c_old|)`
/// (the module docs' bound), `exact` in f64, plus the f64 sum's own error
/// and an absolute slack of the smallest normal f32 for underflow.
#[allow(clippy::too_many_arguments)]
fn check_f64_bound(
    (m, n, k): (usize, usize, usize),
    alpha: f32,
    a: &[f32],
    b: &[f32],
    beta: f32,
    c_old: &[f32],
    got: &[f32],
    what: &str,
) {
    let u = f64::from(f32::EPSILON) / 2.0;
    let kk = (k + 2) as f64;
    let gamma = kk * u / (1.0 - kk * u);
    for i in 0..m {
        for j in 0..n {
            let (mut s, mut abs) = (0.0f64, 0.0f64);
            for p in 0..k {
                let t = f64::from(a[i * k + p]) * f64::from(b[p * n + j]);
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

/// One product on fresh random inputs: the kernel on the emulation against
/// the sequential reference (bit for bit) and the f64 bound.
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
    let (av, bv) = (random(rng, m * k), random(rng, k * n));
    // beta == 0: C poisoned with NaN, which must not be read.
    let c_old = if beta == 0.0 {
        vec![f32::NAN; m * n]
    } else {
        random(rng, m * n)
    };
    let (mut a, mut b, mut c) = (
        Buf::new(&av, offset),
        Buf::new(&bv, offset),
        Buf::new(&c_old, offset),
    );
    emulate_sgemm((m, n, k), alpha, &mut a, &mut b, beta, &mut c).unwrap();
    let mut want = c_old.clone();
    sgemm_reference(m, n, k, alpha, &av, &bv, beta, &mut want);
    let what = format!("{m}x{n}x{k} alpha {alpha} beta {beta} offset {offset}");
    for (i, (g, w)) in c.values().iter().zip(&want).enumerate() {
        assert_eq!(
            g.to_bits(),
            w.to_bits(),
            "{what}: element {i}: got {g}, reference {w}"
        );
    }
    check_f64_bound((m, n, k), alpha, &av, &bv, beta, &c_old, c.values(), &what);
}

const SHAPES: [(usize, usize, usize); 5] = [
    (1, 1, 1),
    (31, 33, 17),
    (64, 64, 64),
    (129, 257, 65),
    (200, 100, 300),
];

#[test]
fn sgemm_with_beta_zero_matches_the_fma_ordered_reference_bit_for_bit_and_never_reads_c() {
    let mut rng = fastrand::Rng::with_seed(0x5e_0001);
    for shape in SHAPES {
        check_shape(&mut rng, shape, 0.0, 0);
    }
}

#[test]
fn sgemm_with_beta_nonzero_matches_the_fma_ordered_reference_bit_for_bit() {
    let mut rng = fastrand::Rng::with_seed(0x5e_0002);
    for shape in SHAPES {
        let beta = rng.f32() * 4.0 - 2.0;
        check_shape(&mut rng, shape, if beta == 0.0 { 0.5 } else { beta }, 0);
    }
}

#[test]
fn sgemm_on_misaligned_slices_takes_the_element_paths_with_the_same_results() {
    let mut rng = fastrand::Rng::with_seed(0x5e_0003);
    // Multiples of 4 (the vector paths' condition) but not 16-byte aligned.
    check_shape(&mut rng, (64, 64, 64), 0.0, 1);
    check_shape(&mut rng, (36, 132, 20), -0.75, 3);
}

#[test]
fn sgemm_at_tile_multiples_with_several_blocks_and_k_steps_matches_the_reference() {
    let mut rng = fastrand::Rng::with_seed(0x5e_0004);
    check_shape(&mut rng, (2 * BM, 2 * BN, 24), 1.0, 0);
}

#[test]
fn sgemm_with_k_zero_sets_c_to_beta_times_c() {
    let mut rng = fastrand::Rng::with_seed(0x5e_0005);
    let (m, n) = (5, 7);
    for beta in [0.0f32, 1.0, -2.5] {
        let c_old = if beta == 0.0 {
            vec![f32::NAN; m * n]
        } else {
            random(&mut rng, m * n)
        };
        let (mut a, mut b, mut c) = (Buf::new(&[], 0), Buf::new(&[], 0), Buf::new(&c_old, 0));
        emulate_sgemm((m, n, 0), 3.0, &mut a, &mut b, beta, &mut c).unwrap();
        for (g, o) in c.values().iter().zip(&c_old) {
            let want = if beta == 0.0 { 0.0 } else { beta * o };
            assert_eq!(
                g.to_bits(),
                want.to_bits(),
                "beta {beta}: got {g}, want {want}"
            );
        }
    }
}

#[test]
fn sgemm_with_m_or_n_zero_launches_one_idle_block_and_writes_nothing() {
    for (m, n, k) in [(0, 9, 4), (9, 0, 4), (0, 0, 0)] {
        let launch = sgemm_launch(m as u32, n as u32, k as u32);
        assert_eq!(launch.grid.volume(), 1);
        let (av, bv) = (vec![1.0; m * k], vec![1.0; k * n]);
        let (mut a, mut b) = (Buf::new(&av, 0), Buf::new(&bv, 0));
        // Guard elements past C's (empty) extent: untouched.
        let mut c = Buf::new(&[7.0; 4], 0);
        c.len = 0;
        emulate_sgemm((m, n, k), 1.0, &mut a, &mut b, 0.0, &mut c).unwrap();
        c.len = 4;
        assert_eq!(c.values(), &[7.0; 4]);
    }
}

#[test]
fn sgemm_traps_on_a_slice_shorter_than_its_matrix() {
    let (m, n, k) = (3, 4, 5);
    let mut a = Buf::new(&vec![1.0; m * k - 1], 0);
    let mut b = Buf::new(&vec![1.0; k * n], 0);
    let mut c = Buf::new(&vec![0.0; m * n], 0);
    let e = emulate_sgemm((m, n, k), 1.0, &mut a, &mut b, 0.0, &mut c).unwrap_err();
    assert_eq!(e.kind, FaultKind::Trap, "{e}");
    assert!(c.values().iter().all(|&x| x == 0.0));
}

#[test]
fn sgemm_launch_plans_one_block_of_256_threads_per_128x128_tile() {
    let l = sgemm_launch(129, 257, 65);
    assert_eq!((l.grid.x, l.grid.y, l.grid.z), (2 * 3, 1, 1));
    assert_eq!((l.block.x, l.block.y, l.block.z), (256, 1, 1));
    assert_eq!(l.dynamic_shared_bytes, 0);
    assert_eq!(sgemm_launch(4096, 4096, 4096).grid.x, 32 * 32);
}
