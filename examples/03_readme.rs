//! Example 3: the README's library snippets, run as written. Each section
//! between `// README snippet` and `// end of snippet` is one ```rust block
//! of README.md, verbatim (`tests/readme.rs` checks that they stay
//! so); around them, what the README leaves to the reader (`n`, `data`,
//! the files read) and checks of what each snippet computed.
//!
//! `cargo run -p gpufeed --release --example 03_readme`
//! (HOST_BACKEND=cpu runs it on the CPU emulation.)

// Not formatted: the snippets are kept as the README shows them.
#[rustfmt::skip]
#[tokio::main]
async fn main() -> gpufeed::Result<()> {
    let n = 1 << 20;
    let data: Vec<f32> = (0..n).map(|i| (i % 1000) as f32).collect();
    let twice: Vec<f32> = data.iter().map(|v| v * 2.0).collect();
    // The files the snippets read and write, in a directory of their own.
    let dir = std::env::temp_dir().join(format!("host-readme-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    std::env::set_current_dir(&dir)?;
    std::fs::write("weights.bin", bytemuck::cast_slice::<f32, u8>(&data))?;

    // README snippet
    use gpufeed::{Device, DeviceBuffer, Kernel, PinnedHost, PinnedPool, Stream};

    let device = Device::from_env()?;               // CUDA if present, else the CPU emulation
    let pool = PinnedPool::new(&device);            // pinned allocation is slow
    let stream = Stream::new(&device)?;
    let mut input = pool.alloc::<f32>(n)?;
    input.as_mut_slice().copy_from_slice(&data);
    let output = pool.alloc::<f32>(n)?;
    let dev = DeviceBuffer::<f32>::new(&device, n)?;

    let ((input, dev, output), ()) = stream
        .run((input, dev, output), |c, (i, d, o)| {
            let d = d.view_mut();                     // exclusive write view
            c.copy_h2d(i.host(), d)?;                 // async H2D from pinned memory
            c.kernel(Kernel::Scale { s: 2.0 }, d)?;
            c.copy_d2h(d, o.host_mut())               // async D2H into pinned memory
        })
        .await?;
    // end of snippet
    println!("{}", device.banner());
    check("a job on a stream", output.as_slice(), &twice)?;

    // README snippet
    use gpufeed::{Pipeline, Plan, Timeline};
    let pipeline = Pipeline::new(&device, 4)?;
    let ((input, output), info) =
        pipeline.run(input, output, Kernel::Scale { s: 2.0 }, Plan::auto(n), Timeline::Off).await?;
    // end of snippet
    check("the pipeline", output.as_slice(), &twice)?;
    println!("the pipeline ran {} chunks", info.chunks);
    drop(input);

    // README snippet
    use gpufeed::kernels::{self, Gemm};
    let (x, m) = (dev.len(), 64);                       // `dev`: x f32 on the device
    let scratch = DeviceBuffer::<f32>::new(&device, kernels::reduce_scratch_len(x))?;
    let words = DeviceBuffer::<u64>::new(&device, kernels::scan_scratch_len(x))?;
    let outs = DeviceBuffer::<f32>::new(&device, 1 + x + m * m)?;
    let ((dev, _, _, outs), ()) = stream
        .run((dev, scratch, words, outs), move |c, (d, s, w, o)| {
            let (d, o) = (d.view(), o.view_mut());
            c.sum(d, s.view_mut(), o.range(..1)?)?;     // deterministic, two passes
            c.inclusive_scan(d, o.range(1..1 + x)?, w.view_mut())?; // also u32, i32
            let a = d.range(..m * m)?;
            c.sgemm(Gemm::new(m, m, m), a, a, o.range(1 + x..)?) // C = A A, f32
        })
        .await?;
    // end of snippet
    let mut got = vec![0f32; 1 + x + m * m];
    let mut outs = outs;
    outs.copy_to_host_sync(&mut got)?;
    check_kernels(&twice, m, &got)?;

    let mut dev = dev;
    let vec = data.clone();
    let mut out = vec![0f32; n];
    let x = data.clone();
    let mut y = vec![0f32; n];
    // README snippet
    use gpufeed::Staging;
    let staging = Staging::new(&device)?;
    staging.h2d(&vec, &mut dev).await?;        // a future borrowing the slice and the device buffer
    staging.d2h(&dev, &mut out).await?;
    staging.h2d_blocking(&vec, &mut dev)?;     // the same, waiting on the calling thread (d2h too)
    let file = std::fs::File::open("weights.bin")?;
    staging.read_file(&file, 0, &mut dev).await?;   // parallel preads, DMA overlapped
    let out_file = std::fs::File::create("out.bin")?;  // opened for writing
    staging.write_file(&dev, &out_file, 0).await?;
    pipeline.run_slices(&staging, &x, &mut y, |c, ch| {  // a Pipeline over Vecs: staged windows
        c.copy_d2d(ch.input::<f32>(0)?, ch.output::<f32>(0)?)?;
        c.kernel(Kernel::Scale { s: 2.0 }, ch.output::<f32>(0)?)
    }).await?;
    // end of snippet
    check("staged copies", &out, &data)?;
    let written = std::fs::read("out.bin")?;
    let written: Vec<f32> = written
        .chunks_exact(4)
        .map(|b| f32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    check("a file read and written", &written, &data)?;
    check("a pipeline over slices", &y, &twice)?;

    // README snippet
    use futures::StreamExt; // Loader is a futures::Stream (add the `futures` crate)
    use gpufeed::{Loader, LoaderConfig, RowSource};
    let rows = RowSource::new(&data, 1024)?; // rows of 1024 values
    let mut loader = Loader::<f32>::new(&device, vec![rows], LoaderConfig::new(64))?;
    let mut seen = 0;                        // epoch 0; loader.start_epoch(e, 0) starts another
    while let Some(b) = loader.next().await {
        let b = b?;                          // b.fields[0]: a DeviceBuffer<f32> of b.rows rows
        seen += b.rows;
    }
    // end of snippet
    if seen != n / 1024 {
        return Err(gpufeed::Error::InvalidArgument(format!(
            "the loader yielded {seen} rows of {}",
            n / 1024
        )));
    }
    std::fs::remove_dir_all(&dir)?;
    println!("every README snippet ran and computed what it should");
    Ok(())
}

/// The kernels snippet's results: the sum and the scan within their
/// documented bounds of an f64 loop's, the GEMM bit for bit a sequential
/// `fma` loop's (its documented order).
fn check_kernels(x: &[f32], m: usize, got: &[f32]) -> gpufeed::Result<()> {
    let n = x.len();
    let u = 1.0 / (1u64 << 24) as f64;
    let (mut exact, mut abs) = (0f64, 0f64);
    for (j, &v) in x.iter().enumerate() {
        exact += v as f64;
        abs += (v as f64).abs();
        let bound = gpufeed::kernels::scan_depth(j) as f64 * u * abs;
        if (got[1 + j] as f64 - exact).abs() > bound {
            return check("the scan", &got[1 + j..2 + j], &[exact as f32]);
        }
    }
    if (got[0] as f64 - exact).abs() > gpufeed::kernels::sum_depth(n) as f64 * u * abs {
        return check("the sum", &got[..1], &[exact as f32]);
    }
    let mut c = vec![0f32; m * m];
    for i in 0..m {
        for j in 0..m {
            c[i * m + j] = (0..m).fold(0f32, |acc, p| x[i * m + p].mul_add(x[p * m + j], acc));
        }
    }
    check("the GEMM", &got[1 + n..], &c)
}

/// An error naming `what` unless `got` equals `want` bit for bit.
fn check(what: &str, got: &[f32], want: &[f32]) -> gpufeed::Result<()> {
    let same = got.len() == want.len()
        && got
            .iter()
            .zip(want)
            .all(|(a, b)| a.to_bits() == b.to_bits());
    if same {
        Ok(())
    } else {
        Err(gpufeed::Error::InvalidArgument(format!(
            "{what}: the result differs from a plain loop's"
        )))
    }
}
