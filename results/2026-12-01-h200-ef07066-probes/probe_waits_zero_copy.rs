//! Temporary diagnostic (not committed): per-run pipeline times under
//! different waits, and a zero-copy kernel over mapped pinned memory.
use cudarc::driver::sys;
use host::{Device, Kernel, PinnedPool, Pipeline, Plan};
use std::time::{Duration, Instant};

fn summ(name: &str, mut v: Vec<f64>) {
    let first: Vec<String> = v.iter().take(12).map(|x| format!("{x:.3}")).collect();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    println!(
        "{name:<26} min {:.3} med {:.3} p90 {:.3} max {:.3} slow>1.05med {}  first {}",
        v[0],
        v[n / 2],
        v[n * 9 / 10],
        v[n - 1],
        v.iter().filter(|&&x| x > v[n / 2] * 1.05).count(),
        first.join(" ")
    );
}

const PTX: &str = r#"
.version 7.0
.target sm_70
.address_size 64
.visible .entry scale_into(.param .u64 px, .param .u64 py, .param .u64 pn4, .param .f32 ps)
{
  .reg .pred p;
  .reg .b64 rd<12>;
  .reg .b32 r<6>;
  .reg .f32 f<8>;
  ld.param.u64 rd1, [px];
  ld.param.u64 rd2, [py];
  ld.param.u64 rd3, [pn4];
  ld.param.f32 f1, [ps];
  mov.u32 r1, %ctaid.x;
  mov.u32 r2, %ntid.x;
  mov.u32 r3, %tid.x;
  mov.u32 r4, %nctaid.x;
  mul.wide.u32 rd4, r1, r2;
  cvt.u64.u32 rd5, r3;
  add.u64 rd4, rd4, rd5;
  mul.wide.u32 rd6, r4, r2;
LOOP:
  setp.ge.u64 p, rd4, rd3;
  @p bra DONE;
  shl.b64 rd7, rd4, 4;
  add.u64 rd8, rd1, rd7;
  ld.global.v4.f32 {f2, f3, f4, f5}, [rd8];
  mul.f32 f2, f2, f1;
  mul.f32 f3, f3, f1;
  mul.f32 f4, f4, f1;
  mul.f32 f5, f5, f1;
  add.u64 rd9, rd2, rd7;
  st.global.v4.f32 [rd9], {f2, f3, f4, f5};
  add.u64 rd4, rd4, rd6;
  bra LOOP;
DONE:
  ret;
}
"#;

fn ck(r: sys::CUresult, what: &str) {
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "{what}");
}

fn zero_copy(device: &Device, n: usize) {
    let ctx = cudarc::driver::CudaContext::new(device.ordinal()).unwrap();
    ctx.bind_to_thread().unwrap();
    let bytes = n * 4;
    unsafe {
        let mut x: *mut std::ffi::c_void = std::ptr::null_mut();
        let mut y: *mut std::ffi::c_void = std::ptr::null_mut();
        let fl = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
        ck(sys::cuMemHostAlloc(&mut x, bytes, fl), "alloc");
        ck(sys::cuMemHostAlloc(&mut y, bytes, fl), "alloc");
        let xs = std::slice::from_raw_parts_mut(x.cast::<f32>(), n);
        for (i, v) in xs.iter_mut().enumerate() {
            *v = (i % 1000) as f32 * 0.5 - 100.0;
        }
        let mut dx = 0;
        let mut dy = 0;
        ck(sys::cuMemHostGetDevicePointer_v2(&mut dx, x, 0), "devptr");
        ck(sys::cuMemHostGetDevicePointer_v2(&mut dy, y, 0), "devptr");
        println!(
            "zero-copy: host {:p} device {:#x} (same: {})",
            x,
            dx,
            x as u64 == dx
        );
        let src = std::ffi::CString::new(PTX).unwrap();
        let mut m = std::ptr::null_mut();
        ck(sys::cuModuleLoadData(&mut m, src.as_ptr().cast()), "module");
        let mut f = std::ptr::null_mut();
        ck(
            sys::cuModuleGetFunction(&mut f, m, c"scale_into".as_ptr()),
            "func",
        );
        let mut s: sys::CUstream = std::ptr::null_mut();
        ck(sys::cuStreamCreate(&mut s, 1), "stream");
        // bidirectional copy bound: H2D x->dev while D2H dev->y
        let mut d1 = 0;
        let mut d2 = 0;
        ck(sys::cuMemAlloc_v2(&mut d1, bytes), "m");
        ck(sys::cuMemAlloc_v2(&mut d2, bytes), "m");
        let mut s2: sys::CUstream = std::ptr::null_mut();
        ck(sys::cuStreamCreate(&mut s2, 1), "stream");
        let mut bound = Vec::new();
        for _ in 0..30 {
            let t = Instant::now();
            ck(sys::cuMemcpyHtoDAsync_v2(d1, x, bytes, s), "h2d");
            ck(sys::cuMemcpyDtoHAsync_v2(y, d2, bytes, s2), "d2h");
            ck(sys::cuStreamSynchronize(s), "sync");
            ck(sys::cuStreamSynchronize(s2), "sync");
            bound.push(t.elapsed().as_secs_f64() * 1e3);
        }
        summ("copy bound (2 whole copies)", bound);
        for blocks_per_sm in [1u32, 2, 4, 8, 16] {
            for threads in [256u32, 512, 1024] {
                if blocks_per_sm * threads > 2048 {
                    continue;
                }
                let grid = 132 * blocks_per_sm;
                let mut n4 = (n / 4) as u64;
                let mut sv = 2.0f32;
                let mut v = Vec::new();
                for _ in 0..20 {
                    std::ptr::write_bytes(y.cast::<u8>(), 0, 4096);
                    let mut args = [
                        (&mut dx as *mut u64).cast::<std::ffi::c_void>(),
                        (&mut dy as *mut u64).cast(),
                        (&mut n4 as *mut u64).cast(),
                        (&mut sv as *mut f32).cast(),
                    ];
                    let t = Instant::now();
                    ck(
                        sys::cuLaunchKernel(
                            f,
                            grid,
                            1,
                            1,
                            threads,
                            1,
                            1,
                            0,
                            s,
                            args.as_mut_ptr(),
                            std::ptr::null_mut(),
                        ),
                        "launch",
                    );
                    ck(sys::cuStreamSynchronize(s), "sync");
                    v.push(t.elapsed().as_secs_f64() * 1e3);
                }
                let ys = std::slice::from_raw_parts(y.cast::<f32>(), n);
                let ok = xs
                    .iter()
                    .zip(ys)
                    .all(|(a, b)| (a * 2.0).to_bits() == b.to_bits());
                summ(&format!("zero-copy {grid}x{threads} ok={ok}"), v);
            }
        }
    }
}

fn main() -> host::Result<()> {
    let device = Device::from_env()?;
    println!("{}", device.banner());
    let n = 10_000_000usize;
    let pool = PinnedPool::new(&device);
    let pipe = Pipeline::new(&device, 4)?;
    let mut input = pool.alloc::<f32>(n)?;
    for (i, v) in input.as_mut_slice().iter_mut().enumerate() {
        *v = (i % 1000) as f32 * 0.5 - 100.0;
    }
    let mut out = pool.alloc::<f32>(n)?;
    let k = Kernel::Scale { s: 2.0 };
    for plan in [Plan::auto(n)] {
        println!("plan {plan}");
        for (name, how) in [
            ("futures block_on", 0),
            ("host::block_on", 1),
            ("spin whole wait", 2),
            ("futures, touch input", 3),
            ("spin, touch input", 4),
            ("futures, touch output", 5),
            ("futures block_on again", 0),
            ("spin whole wait again", 2),
        ] {
            let mut v = Vec::new();
            for r in 0..63 {
                if how == 3 || how == 4 {
                    for x in input.as_mut_slice().iter_mut() {
                        *x += 0.0;
                    }
                }
                if how == 5 {
                    out.as_mut_slice().fill(0.0);
                }
                let t = Instant::now();
                let fut = pipe.run(input, out, k, plan, false);
                let ((i, o), _) = match how {
                    0 | 3 | 5 => futures::executor::block_on(fut)?,
                    1 => host::block_on(fut)?,
                    _ => host::block_on_spinning(fut, Duration::from_millis(50))?,
                };
                let ms = t.elapsed().as_secs_f64() * 1e3;
                (input, out) = (i, o);
                if r >= 3 {
                    v.push(ms);
                }
            }
            summ(name, v);
        }
    }
    drop((input, out, pipe));
    zero_copy(&device, n);
    Ok(())
}
