//! `sum` and `max` (f32 and bf16) on the CPU emulation, with the plan's
//! launches: against an independent f64 plain loop (sum, within the plan's
//! documented bound), a plain-loop maximum (exact), and a sequential model
//! of the documented fixed order (bit-exact), on aligned and misaligned
//! inputs of every size.

mod common;

use common::{block_tree, launch, uniform, Buf, SIZES, U};
use gpu_kernels::reduce::{self, ReducePlan, REDUCE_BLOCK};

fn add(a: f32, b: f32) -> f32 {
    a + b
}

fn max(a: f32, b: f32) -> f32 {
    a.max(b)
}

/// The documented order, sequentially: per-thread chunk accumulators,
/// their pair tree, the block tree, then pass 2's folds and block tree.
fn model(
    x: &[f32],
    e: usize,
    plan: &ReducePlan,
    id: f32,
    op: fn(f32, f32) -> f32,
) -> (Vec<f32>, f32) {
    let (n, b) = (x.len(), REDUCE_BLOCK as usize);
    let threads = plan.partials * b;
    let chunks = n.div_ceil(e);
    let partials: Vec<f32> = (0..plan.partials)
        .map(|blk| {
            let vals: Vec<f32> = (0..b)
                .map(|t| {
                    let mut acc = vec![id; e];
                    let mut c = blk * b + t;
                    while c < chunks {
                        for (j, a) in acc.iter_mut().enumerate() {
                            if c * e + j < n {
                                *a = op(*a, x[c * e + j]);
                            }
                        }
                        c += threads;
                    }
                    while acc.len() > 1 {
                        acc = acc.chunks(2).map(|p| op(p[0], p[1])).collect();
                    }
                    acc[0]
                })
                .collect();
            block_tree(&vals, op)
        })
        .collect();
    let vals: Vec<f32> = (0..256)
        .map(|t| {
            partials
                .iter()
                .skip(t)
                .step_by(256)
                .fold(id, |a, &p| op(a, p))
        })
        .collect();
    (partials, block_tree(&vals, op))
}

/// Runs pass 1 (kernel `P`) and pass 2 (kernel `F`) and returns `out[0]`.
fn run<P, F, T>(x: &[T], offset: usize, plan: &ReducePlan) -> (Vec<f32>, f32)
where
    P: kernel_abi::Kernel<Params = (kernel_abi::Slice<T>, kernel_abi::SliceMut<f32>)>,
    F: kernel_abi::Kernel<Params = (kernel_abi::Slice<f32>, kernel_abi::SliceMut<f32>)>,
    T: Copy + Sync + Send,
{
    let mut xb = Buf::new(x, offset);
    let mut partials = Buf::new(&vec![f32::NAN; plan.partials], 0);
    let mut out = Buf::new(&[f32::NAN], 0);
    launch::<P>(plan.pass1, 2, (xb.slice(), partials.slice_mut()));
    assert!(
        partials.contents().iter().all(|p| !p.is_nan()),
        "a partial left unwritten"
    );
    launch::<F>(plan.pass2, 2, (partials.slice(), out.slice_mut()));
    (partials.contents(), out.contents()[0])
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

fn check(
    x: &[f32],
    sum: (Vec<f32>, f32),
    max_: (Vec<f32>, f32),
    e: usize,
    plan: &ReducePlan,
    what: &str,
) {
    let (got_sum, got_max) = (sum.1, max_.1);
    let exact: f64 = x.iter().map(|&v| v as f64).sum();
    let abs: f64 = x.iter().map(|&v| (v as f64).abs()).sum();
    let bound = plan.depth as f64 * U * abs;
    assert!(
        (got_sum as f64 - exact).abs() <= bound,
        "{what}: sum {got_sum} vs {exact} (bound {bound})"
    );
    let want_max = x
        .iter()
        .fold(f32::NEG_INFINITY, |a, &v| if v > a { v } else { a });
    assert_eq!(got_max, want_max, "{what}: max");
    let (partials, total) = model(x, e, plan, 0.0, add);
    assert!(
        same_bits(&sum.0, &partials),
        "{what}: sum partials not in the documented order"
    );
    assert_eq!(got_sum.to_bits(), total.to_bits(), "{what}: sum order");
    let (partials, total) = model(x, e, plan, f32::NEG_INFINITY, max);
    assert!(same_bits(&max_.0, &partials), "{what}: max partials");
    assert_eq!(got_max.to_bits(), total.to_bits(), "{what}: max order");
}

/// Values of both signs over 2^-12 .. 2^12: the order of additions shows
/// in the rounded results.
fn wide(rng: &mut fastrand::Rng, n: usize) -> Vec<f32> {
    uniform(rng, n)
        .into_iter()
        .map(|v| v * (2.0f32).powi(rng.i32(-12..12)))
        .collect()
}

#[test]
fn f32_sum_and_max_meet_the_f64_reference_and_the_fixed_order_bit_for_bit() {
    let mut rng = fastrand::Rng::with_seed(40);
    for n in SIZES {
        let x = wide(&mut rng, n);
        let plan = reduce::reduce_plan_f32(n);
        for offset in [0, 4] {
            let s = run::<reduce::sum_f32, reduce::sum_finish_f32, f32>(&x, offset, &plan);
            let m = run::<reduce::max_f32, reduce::max_finish_f32, f32>(&x, offset, &plan);
            check(&x, s, m, 4, &plan, &format!("f32 n={n} offset={offset}"));
        }
    }
}

#[test]
fn bf16_sum_and_max_accumulate_in_f32_and_meet_the_references() {
    let mut rng = fastrand::Rng::with_seed(41);
    for n in SIZES {
        let bits: Vec<u16> = wide(&mut rng, n)
            .iter()
            .map(|v| (v.to_bits() >> 16) as u16)
            .collect();
        let x: Vec<f32> = bits
            .iter()
            .map(|&b| f32::from_bits((b as u32) << 16))
            .collect();
        let plan = reduce::reduce_plan_bf16(n);
        for offset in [0, 2] {
            let s = run::<reduce::sum_bf16, reduce::sum_finish_f32, u16>(&bits, offset, &plan);
            let m = run::<reduce::max_bf16, reduce::max_finish_f32, u16>(&bits, offset, &plan);
            check(&x, s, m, 8, &plan, &format!("bf16 n={n} offset={offset}"));
        }
    }
}

#[test]
fn the_plan_depends_on_n_alone_and_caps_the_grid() {
    let p = reduce::reduce_plan_f32(1 << 28);
    assert_eq!(p.partials, 1024);
    assert_eq!(p.depth, 256 + 2 + 8 + 4 + 8);
    assert_eq!(reduce::reduce_plan_f32(0).partials, 1);
    assert_eq!(reduce::reduce_plan_f32(1_000_007).pass1.grid.x, 62);
    assert_eq!(reduce::reduce_plan_bf16(1_000_007).pass1.grid.x, 31);
}
