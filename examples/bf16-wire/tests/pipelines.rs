//! The three variants through `Pipeline::run_stage` on every backend, bit
//! for bit against the CPU reference, at a few sizes and plans: f32 (the
//! in-tree scale kernel), bf16 in / f32 out, bf16 both ways.

mod common;

use bf16_wire::{bf16, narrow_to_pinned, run_bf16, run_bf16_f32, run_f32, Variant};
use common::rne_reference;
use futures::executor::block_on;
use gpufeed::testing::{random_floats, serial};
use gpufeed::{Kernel, PinnedPool, Pipeline, Plan, Timeline};

/// Not a power of two: the products round.
const S: f32 = 3.3;

fn plans(n: usize) -> Vec<Plan> {
    vec![
        Plan::uniform(1, 1),
        Plan::uniform(5, 2),
        Plan::uniform(7, 3).chained(),
        Plan::engines(6, 2),
        Plan::engines(9, 3).ramped(),
        Plan::auto(n),
    ]
    .into_iter()
    .map(|p| Plan {
        chunks: p.chunks.min(n),
        ..p
    })
    .collect()
}

gpufeed::backend_tests!(every_variant_matches_the_cpu_bit_for_bit);
fn every_variant_matches_the_cpu_bit_for_bit(device: gpufeed::Device) {
    let _serial = serial();
    let pool = PinnedPool::new(&device);
    let pipe = Pipeline::new(&device, 3).unwrap();
    let kernels = bf16_wire::load(&device).unwrap();
    for (k, n) in [1usize, 1000, 65_537, 1_000_003].into_iter().enumerate() {
        let mut data = vec![0f32; n];
        random_floats(&mut data, 40 + k as u64);
        assert!(data.iter().all(|v| *v != 0.0));
        for plan in plans(n) {
            let what = format!("{} n={n} {plan}", device.kind());

            // f32 both ways (the reference variant).
            let mut x = pool.alloc::<f32>(n).unwrap();
            x.as_mut_slice().copy_from_slice(&data);
            let y = pool.alloc::<f32>(n).unwrap();
            let (((x,), (y,)), info) = block_on(run_f32(&pipe, x, y, S, plan, Timeline::Off))
                .unwrap_or_else(|e| panic!("{what} f32: {e}"));
            assert_eq!(info.plan, plan);
            for (i, (a, b)) in x.as_slice().iter().zip(y.as_slice()).enumerate() {
                let want = Kernel::Scale { s: S }.reference(*a);
                assert_eq!(b.to_bits(), want.to_bits(), "{what} f32: element {i}");
            }

            // bf16 in, f32 out.
            let xb = narrow_to_pinned(&pool, &data).unwrap();
            let y = pool.alloc::<f32>(n).unwrap();
            let (((xb,), (y,)), _) =
                block_on(run_bf16_f32(&pipe, &kernels, xb, y, S, plan, Timeline::Off))
                    .unwrap_or_else(|e| panic!("{what} bf16->f32: {e}"));
            for (i, (a, b)) in xb.as_slice().iter().zip(y.as_slice()).enumerate() {
                // half's widening: independent of the kernel's.
                let want = a.to_f32() * S;
                assert_eq!(b.to_bits(), want.to_bits(), "{what} bf16->f32: element {i}");
            }

            // bf16 both ways.
            let y = pool.alloc::<bf16>(n).unwrap();
            let (((xb,), (y,)), _) =
                block_on(run_bf16(&pipe, &kernels, xb, y, S, plan, Timeline::Off))
                    .unwrap_or_else(|e| panic!("{what} bf16: {e}"));
            for (i, (a, b)) in xb.as_slice().iter().zip(y.as_slice()).enumerate() {
                let want = rne_reference(a.to_f32() * S).expect("finite");
                assert_eq!(b.to_bits(), want, "{what} bf16: element {i}");
            }
        }
    }
}

gpufeed::backend_tests!(a_stage_with_the_wrong_element_type_hands_the_arrays_back);
fn a_stage_with_the_wrong_element_type_hands_the_arrays_back(device: gpufeed::Device) {
    // run_bf16_f32 given f32 input would not compile (PinnedArray<Elem =
    // bf16>); at run time the chunk's type check guards a hand-written stage.
    let _serial = serial();
    let pool = PinnedPool::new(&device);
    let pipe = Pipeline::new(&device, 2).unwrap();
    let kernels = bf16_wire::load(&device).unwrap();
    let (x, y) = (
        pool.alloc::<f32>(1000).unwrap(),
        pool.alloc::<f32>(1000).unwrap(),
    );
    let err = block_on(pipe.run_stage(
        (x,),
        (y,),
        Plan::uniform(2, 2),
        Timeline::Off,
        |c, chunk| kernels.scale_to_f32(c, 2.0, chunk.input::<bf16>(0)?, chunk.output::<f32>(0)?),
    ))
    .unwrap_err();
    assert!(
        matches!(&err.error, gpufeed::Error::InvalidArgument(m) if m.contains("holds f32")),
        "{err}"
    );
    assert!(err.bundle.is_some());
}

#[test]
fn bytes_per_element_of_each_variant() {
    let moved: Vec<(usize, usize)> = Variant::ALL
        .iter()
        .map(|v| (v.h2d_bytes(), v.d2h_bytes()))
        .collect();
    assert_eq!(moved, [(4, 4), (2, 4), (2, 2)]);
    assert_eq!(Variant::Bf16BothWays.label(), "bf16-both-ways");
}
