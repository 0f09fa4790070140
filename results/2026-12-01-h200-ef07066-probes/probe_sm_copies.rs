//! Temporary diagnostic (not committed): per-run pipeline times under
//! different waits, and a zero-copy kernel over mapped pinned memory.
use cudarc::driver::sys;
use host::Device;
use std::time::Instant;

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


struct Launcher {
    f: sys::CUfunction,
}
impl Launcher {
    unsafe fn copy(&self, dst: u64, src: u64, bytes: usize, grid: u32, s: sys::CUstream) {
        let mut dx = src;
        let mut dy = dst;
        let mut n4 = (bytes / 16) as u64;
        let mut sv = 1.0f32;
        let mut args = [
            (&mut dx as *mut u64).cast::<std::ffi::c_void>(),
            (&mut dy as *mut u64).cast(),
            (&mut n4 as *mut u64).cast(),
            (&mut sv as *mut f32).cast(),
        ];
        ck(unsafe { sys::cuLaunchKernel(self.f, grid, 1, 1, 256, 1, 1, 0, s, args.as_mut_ptr(), std::ptr::null_mut()) }, "launch");
    }
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
        let src = std::ffi::CString::new(PTX).unwrap();
        let mut m = std::ptr::null_mut();
        ck(sys::cuModuleLoadData(&mut m, src.as_ptr().cast()), "module");
        let mut f = std::ptr::null_mut();
        ck(sys::cuModuleGetFunction(&mut f, m, c"scale_into".as_ptr()), "func");
        let l = Launcher { f };
        let mut a: sys::CUstream = std::ptr::null_mut();
        let mut b: sys::CUstream = std::ptr::null_mut();
        ck(sys::cuStreamCreate(&mut a, 1), "stream");
        ck(sys::cuStreamCreate(&mut b, 1), "stream");
        let mut d1 = 0;
        let mut d2 = 0;
        ck(sys::cuMemAlloc_v2(&mut d1, bytes), "m");
        ck(sys::cuMemAlloc_v2(&mut d2, bytes), "m");
        let (hx, hy) = (x as u64, y as u64);
        let time = |name: &str, f: &dyn Fn()| {
            let mut v = Vec::new();
            for _ in 0..25 {
                let t = Instant::now();
                f();
                ck(sys::cuStreamSynchronize(a), "sync");
                ck(sys::cuStreamSynchronize(b), "sync");
                v.push(t.elapsed().as_secs_f64() * 1e3);
            }
            v.drain(..3);
            summ(name, v);
        };
        time("CE h2d alone", &|| { ck(sys::cuMemcpyHtoDAsync_v2(d1, x, bytes, a), "h2d"); });
        time("CE d2h alone", &|| { ck(sys::cuMemcpyDtoHAsync_v2(y, d2, bytes, b), "d2h"); });
        time("CE bound (both)", &|| {
            ck(sys::cuMemcpyHtoDAsync_v2(d1, x, bytes, a), "h2d");
            ck(sys::cuMemcpyDtoHAsync_v2(y, d2, bytes, b), "d2h");
        });
        for grid in [132u32, 264, 528, 1056] {
            time(&format!("SM d2h alone g{grid}"), &|| l.copy(hy, d2, bytes, grid, b));
            time(&format!("SM h2d alone g{grid}"), &|| l.copy(d1, hx, bytes, grid, a));
            time(&format!("CE h2d + SM d2h g{grid}"), &|| {
                ck(sys::cuMemcpyHtoDAsync_v2(d1, x, bytes, a), "h2d");
                l.copy(hy, d2, bytes, grid, b);
            });
            time(&format!("SM h2d + CE d2h g{grid}"), &|| {
                l.copy(d1, hx, bytes, grid, a);
                ck(sys::cuMemcpyDtoHAsync_v2(y, d2, bytes, b), "d2h");
            });
        }
        for pieces in [8usize, 16, 32] {
            let piece = bytes / pieces;
            time(&format!("CE+CE {pieces} pieces"), &|| {
                for i in 0..pieces {
                    let o = (i * piece) as u64;
                    ck(sys::cuMemcpyHtoDAsync_v2(d1 + o, (hx + o) as *const _, piece, a), "h2d");
                    ck(sys::cuMemcpyDtoHAsync_v2((hy + o) as *mut _, d2 + o, piece, b), "d2h");
                }
            });
            for grid in [264u32, 528] {
                time(&format!("CE h2d + SM d2h {pieces} pieces g{grid}"), &|| {
                    for i in 0..pieces {
                        let o = (i * piece) as u64;
                        ck(sys::cuMemcpyHtoDAsync_v2(d1 + o, (hx + o) as *const _, piece, a), "h2d");
                        l.copy(hy + o, d2 + o, piece, grid, b);
                    }
                });
            }
        }
        // correctness of SM d2h
        ck(sys::cuMemcpyHtoD_v2(d2, x, bytes), "h2d");
        l.copy(hy, d2, bytes, 528, b);
        ck(sys::cuStreamSynchronize(b), "sync");
        let ys = std::slice::from_raw_parts(y.cast::<f32>(), n);
        println!("SM d2h bit-exact: {}", xs.iter().zip(ys).all(|(p, q)| p.to_bits() == q.to_bits()));
    }
}

fn main() -> host::Result<()> {
    let device = Device::from_env()?;
    println!("{}", device.banner());
    zero_copy(&device, 10_000_000);
    Ok(())
}
