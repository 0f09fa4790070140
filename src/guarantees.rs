//! What the types guarantee, each with a program that must not compile.
//!
//! Every example below is a `compile_fail` test: CI builds each one and
//! checks it fails, with the error code named on its fence (CI runs the doc
//! tests once with `RUSTC_BOOTSTRAP=1`, which makes rustdoc check the codes:
//! a test that failed for another reason would fail there). Below each, what
//! the program would do if it compiled.
//!
//! What is checked at run time instead (and tested in `tests/soundness.rs`):
//! lengths and ranges (`LengthMismatch`, `OutOfBounds`), buffers of another
//! device (`InvalidArgument`), partially overlapping operands of one command
//! (`Overlap`), a panic inside a batch (the enqueued commands finish before
//! the bundle is dropped), and timing of untimed or unfinished events
//! (`NotTimed`, `NotReady`).
//!
//! # 1. Pageable memory can't go to an async copy
//! Async copies take [`PinnedHost`](crate::PinnedHost) memory only: a `Vec`
//! would be copied by the driver through a staging buffer, synchronously,
//! while the code reads as if it overlapped.
//! ```compile_fail,E0277
//! # fn f(device: &gpufeed::Device, stream: &gpufeed::Stream) -> gpufeed::Result<()> {
//! let pageable = vec![1.0f32; 1024];
//! let dev = gpufeed::DeviceBuffer::<f32>::new(device, 1024)?;
//! let job = stream.copy_h2d(pageable, dev);
//! # Ok(()) }
//! ```
//! Nor as a command's source: a host view comes only from pinned memory.
//! ```compile_fail,E0308
//! # fn f(device: &gpufeed::Device, stream: &gpufeed::Stream) -> gpufeed::Result<()> {
//! let pageable = vec![1.0f32; 1024];
//! let dev = gpufeed::DeviceBuffer::<f32>::new(device, 1024)?;
//! let job = stream.run(dev, |c, d| c.copy_h2d(pageable.as_slice(), d.view_mut()));
//! # Ok(()) }
//! ```
//!
//! # 2. A buffer given to a job can't be used until it is handed back
//! The job owns it; reading it while the copy runs would read torn data.
//! ```compile_fail,E0382
//! # fn f(device: &gpufeed::Device, stream: &gpufeed::Stream) -> gpufeed::Result<()> {
//! let input = gpufeed::PinnedBuffer::<f32>::new(device, 1024)?;
//! let dev = gpufeed::DeviceBuffer::<f32>::new(device, 1024)?;
//! let job = stream.copy_h2d(input, dev);
//! let first = input.as_slice()[0];
//! # Ok(()) }
//! ```
//! The same for a run spread over several devices: the whole array belongs
//! to the run until every device is done with its part.
//! ```compile_fail,E0382
//! # fn f(devices: &[gpufeed::Device], pool: &gpufeed::PinnedPool) -> gpufeed::Result<()> {
//! let multi = gpufeed::MultiPipeline::new(devices, 3)?;
//! let (mut x, y) = (pool.alloc::<f32>(1024)?, pool.alloc::<f32>(1024)?);
//! let job = multi.run(x, y, gpufeed::Kernel::Scale { s: 2.0 }, gpufeed::Plan::auto(1024));
//! x.as_mut_slice()[0] = 1.0; // another device may be reading it
//! # Ok(()) }
//! ```
//!
//! # 3. Inside a batch, host memory handed to a command stays borrowed
//! A destination of a device-to-host copy can't be written by the CPU in the
//! same batch (the copy would overwrite it, or the CPU the copy's result).
//! ```compile_fail,E0499
//! # fn f(device: &gpufeed::Device, stream: &gpufeed::Stream) -> gpufeed::Result<()> {
//! use gpufeed::PinnedHost;
//! let out = gpufeed::PinnedBuffer::<f32>::new(device, 1024)?;
//! let dev = gpufeed::DeviceBuffer::<f32>::new(device, 1024)?;
//! let job = stream.run((dev, out), |c, (d, o)| {
//!     c.copy_d2h(d.view(), o.host_mut())?;
//!     o.as_mut_slice()[0] = 1.0;
//!     Ok(())
//! });
//! # Ok(()) }
//! ```
//!
//! # 4. Device memory used by a queued command can't be dropped
//! Every view a command takes is borrowed from the job's bundle for the
//! whole batch: a device buffer outside the bundle can't be used, so it
//! can't be freed while a command queued on it is pending.
//! ```compile_fail,E0597
//! # fn f(device: &gpufeed::Device, stream: &gpufeed::Stream) -> gpufeed::Result<()> {
//! use gpufeed::PinnedHost;
//! let input = gpufeed::PinnedBuffer::<f32>::new(device, 1024)?;
//! let mut outside = gpufeed::DeviceBuffer::<f32>::new(device, 1024)?;
//! let job = stream.run(input, |c, i| c.copy_h2d(i.host(), outside.view_mut()));
//! drop(outside);
//! # Ok(()) }
//! ```
//! The same for a batch of copies ([`Commands::copy_batch`](crate::Commands::copy_batch)):
//! its transfers take the same views.
//! ```compile_fail,E0597
//! # fn f(device: &gpufeed::Device, stream: &gpufeed::Stream) -> gpufeed::Result<()> {
//! use gpufeed::PinnedHost;
//! let input = gpufeed::PinnedBuffer::<f32>::new(device, 1024)?;
//! let mut outside = gpufeed::DeviceBuffer::<f32>::new(device, 1024)?;
//! let job = stream.run(input, |c, i| {
//!     c.copy_batch([gpufeed::Transfer::h2d(i.host(), outside.view_mut())])
//! });
//! drop(outside);
//! # Ok(()) }
//! ```
//! A view can't leave its batch either (to be used by a later one):
//! ```compile_fail
//! # fn f(device: &gpufeed::Device, stream: &gpufeed::Stream) -> gpufeed::Result<()> {
//! let dev = gpufeed::DeviceBuffer::<f32>::new(device, 1024)?;
//! let mut kept = None;
//! let job = stream.run(dev, |c, d| {
//!     kept = Some(d.view_mut());
//!     Ok(())
//! });
//! # Ok(()) }
//! ```
//!
//! # 5. Device memory shared between jobs is read-only
//! A buffer behind an `Arc` may be read by several jobs at once; writing
//! needs `&mut DeviceBuffer`, which no shared owner has (two jobs on two
//! streams writing one buffer would race).
//! ```compile_fail,E0596
//! # fn f(device: &gpufeed::Device, stream: &gpufeed::Stream) -> gpufeed::Result<()> {
//! use std::sync::Arc;
//! let shared = Arc::new(gpufeed::DeviceBuffer::<f32>::new(device, 1024)?);
//! let job = stream.run(shared.clone(), |c, d| {
//!     c.kernel(gpufeed::Kernel::Scale { s: 2.0 }, d.view_mut())
//! });
//! # Ok(()) }
//! ```
//! And one batch can't read a buffer through one borrow while writing it
//! through another (the two operands of `saxpy` would alias).
//! ```compile_fail,E0502
//! # fn f(device: &gpufeed::Device, stream: &gpufeed::Stream) -> gpufeed::Result<()> {
//! let dev = gpufeed::DeviceBuffer::<f32>::new(device, 1024)?;
//! let job = stream.run(dev, |c, d| c.saxpy(2.0, d.view(), d.view_mut()));
//! # Ok(()) }
//! ```
//!
//! # 6. A job can't be completed from outside
//! Only the backend's completion source finishes a job; there is no handle
//! to its completion (which would let a caller get the buffers back while
//! the GPU still uses them).
//! ```compile_fail,E0599
//! # fn f(device: &gpufeed::Device, stream: &gpufeed::Stream) -> gpufeed::Result<()> {
//! let dev = gpufeed::DeviceBuffer::<f32>::new(device, 1024)?;
//! let job = stream.launch(gpufeed::Kernel::Scale { s: 2.0 }, dev);
//! job.completion();
//! # Ok(()) }
//! ```
//! ```compile_fail,E0603
//! let c = gpufeed::base::completion::Completion::new();
//! ```
//!
//! # 7. A timeline point can't be awaited
//! The points of a pipeline timeline ([`Mark`](crate::Mark)) are not watched
//! (that keeps them from disturbing what they measure); awaiting one would
//! wait forever, so the type has no way to.
//! ```compile_fail,E0599
//! # async fn f(info: gpufeed::RunInfo) {
//! let points = info.timeline.unwrap();
//! points[0].events[0].wait().await;
//! # }
//! ```
//!
//! # 8. Pinned in place: the vector can't move or be freed while registered
//! [`Registered`](crate::Registered) owns the `Vec`, so a push (which may
//! reallocate) or a drop needs it back, which unregisters first.
//! ```compile_fail,E0382
//! # fn f(device: &gpufeed::Device) -> gpufeed::Result<()> {
//! let mut v = vec![1.0f32; 1024];
//! let pinned = gpufeed::Registered::new(device, v)?;
//! v.push(2.0);
//! # Ok(()) }
//! ```
//!
//! # 9. A kernel's arguments match its declaration
//! A launch's argument tuple is checked against the parameter list the
//! kernel's crate declared: a read view where the kernel writes, a scalar of
//! another type, a missing argument, all fail to compile (the kernel would
//! read a wrong-sized parameter or write memory lent as read-only).
//! ```compile_fail,E0271
//! # fn f(device: &gpufeed::Device, stream: &gpufeed::Stream) -> gpufeed::Result<()> {
//! gpufeed::kernel_abi::kernels! {
//!     /// Doubles `x`.
//!     pub unsafe fn double(x: gpufeed::kernel_abi::SliceMut<f32>) {}
//! }
//! let f = unsafe { gpufeed::Module::from_ptx(device, "")? }.function::<double>()?;
//! let dev = gpufeed::DeviceBuffer::<f32>::new(device, 1024)?;
//! let job = stream.run(dev, move |c, d| {
//!     c.launch(&f, gpufeed::LaunchConfig::SINGLE, (d.view(),)) // read-only view
//! });
//! # Ok(()) }
//! ```
//! ```compile_fail,E0271
//! # fn f(device: &gpufeed::Device, stream: &gpufeed::Stream) -> gpufeed::Result<()> {
//! gpufeed::kernel_abi::kernels! {
//!     /// Scales `x` by `s`.
//!     pub unsafe fn scale_by(x: gpufeed::kernel_abi::SliceMut<f32>, s: f32) {}
//! }
//! let f = unsafe { gpufeed::Module::from_ptx(device, "")? }.function::<scale_by>()?;
//! let dev = gpufeed::DeviceBuffer::<f32>::new(device, 1024)?;
//! let job = stream.run(dev, move |c, d| {
//!     c.launch(&f, gpufeed::LaunchConfig::SINGLE, (d.view_mut(), 2.0f64)) // f64 for f32
//! });
//! # Ok(()) }
//! ```
//! The declaration and the PTX are tied by the kernel's name only, so loading
//! PTX is `unsafe`: the caller promises it was built from the crate whose
//! declarations it launches (an entry of the same name elsewhere, say
//! `scale` over `f32`s declared over `u8`s, would write out of bounds).
//! ```compile_fail,E0133
//! # fn f(device: &gpufeed::Device) -> gpufeed::Result<()> {
//! let m = gpufeed::Module::from_ptx(device, gpufeed::ptx::PTX)?;
//! # Ok(()) }
//! ```
//!
//! # 10. A pipeline's arrays are described by the library only
//! [`Arrays`](crate::Arrays) is sealed: the pipeline copies to and from the
//! addresses an implementation reports, so one written outside the crate
//! could report memory it does not own (a buffer already freed). A run with
//! no host outputs keeps its device memory alive with
//! [`KeepAlive`](crate::KeepAlive) instead.
//! ```compile_fail,E0277
//! struct MyArrays(Vec<f32>);
//! impl gpufeed::Arrays for MyArrays {}
//! ```
//!
//! # 11. A batch takes write views of its own borrow of the bundle only
//! A write view is `Copy` within its batch; were a view of a longer borrow
//! (a leaked `&'static mut DeviceBuffer`'s) accepted, it could reach two
//! batches on two streams, both writing the buffer at once.
//! [`DeviceSliceMut`](crate::DeviceSliceMut) is invariant in its lifetime:
//! a batch's commands take exactly the batch's own.
//! ```compile_fail,E0521
//! # use gpufeed::PinnedHost;
//! # fn f(device: &gpufeed::Device, s1: &gpufeed::Stream) -> gpufeed::Result<()> {
//! let leaked: &'static mut gpufeed::DeviceBuffer<u32> =
//!     Box::leak(Box::new(gpufeed::DeviceBuffer::new(device, 1024)?));
//! let view = leaked.view_mut();
//! let ones = gpufeed::PinnedBuffer::<u32>::new(device, 1024)?;
//! let job = s1.run(ones, move |c, h| c.copy_h2d(h.host(), view));
//! # Ok(()) }
//! ```
//! The same for a batch of copies:
//! ```compile_fail,E0521
//! # use gpufeed::PinnedHost;
//! # fn f(device: &gpufeed::Device, s1: &gpufeed::Stream) -> gpufeed::Result<()> {
//! let leaked: &'static mut gpufeed::DeviceBuffer<u32> =
//!     Box::leak(Box::new(gpufeed::DeviceBuffer::new(device, 1024)?));
//! let view = leaked.view_mut();
//! let ones = gpufeed::PinnedBuffer::<u32>::new(device, 1024)?;
//! let job = s1.run(ones, move |c, h| c.copy_batch([gpufeed::Transfer::h2d(h.host(), view)]));
//! # Ok(()) }
//! ```
//!
//! # 12. A staged copy borrows its host memory and its device buffer
//! [`Staging`](crate::Staging) copies ordinary memory; the copy future
//! borrows the host slice (shared one way, exclusively the other) and the
//! device buffer until it resolves or is dropped. Writing the source while
//! it is being sent would send torn data:
//! ```compile_fail,E0502
//! # async fn f(device: &gpufeed::Device, staging: &gpufeed::Staging) -> gpufeed::Result<()> {
//! let mut data = vec![1.0f32; 1024];
//! let mut dev = gpufeed::DeviceBuffer::<f32>::new(device, 1024)?;
//! let copy = staging.h2d(&data, &mut dev);
//! data[0] = 2.0;
//! copy.await?;
//! # Ok(()) }
//! ```
//! Reading the destination before the copy has filled it:
//! ```compile_fail,E0502
//! # async fn f(device: &gpufeed::Device, staging: &gpufeed::Staging) -> gpufeed::Result<()> {
//! let mut out = vec![0.0f32; 1024];
//! let dev = gpufeed::DeviceBuffer::<f32>::new(device, 1024)?;
//! let copy = staging.d2h(&dev, &mut out);
//! let first = out[0];
//! copy.await?;
//! # Ok(()) }
//! ```
//! Using the device buffer in a job meanwhile:
//! ```compile_fail,E0499
//! # async fn f(device: &gpufeed::Device, staging: &gpufeed::Staging, s: &gpufeed::Stream) -> gpufeed::Result<()> {
//! let data = vec![1.0f32; 1024];
//! let mut dev = gpufeed::DeviceBuffer::<f32>::new(device, 1024)?;
//! let copy = staging.h2d(&data, &mut dev);
//! let view = dev.view_mut();
//! copy.await?;
//! # Ok(()) }
//! ```
//! Nor can the copy outlive the memory it reads:
//! ```compile_fail,E0597
//! # fn f(device: &gpufeed::Device, staging: &gpufeed::Staging) -> gpufeed::Result<()> {
//! let mut dev = gpufeed::DeviceBuffer::<f32>::new(device, 1024)?;
//! let copy = {
//!     let data = vec![1.0f32; 1024];
//!     staging.h2d(&data, &mut dev)
//! };
//! # drop(copy); Ok(()) }
//! ```
//! A pipeline run over ordinary slices ([`Pipeline::run_slices`](crate::Pipeline::run_slices))
//! borrows them the same way: the output can't be read before the run has
//! written it.
//! ```compile_fail,E0502
//! # async fn f(pipe: &gpufeed::Pipeline, staging: &gpufeed::Staging) -> gpufeed::Result<()> {
//! let x = vec![1.0f32; 1024];
//! let mut y = vec![0.0f32; 1024];
//! let run = pipe.run_slices(staging, &x, &mut y, |c, chunk| {
//!     c.copy_d2d(chunk.input::<f32>(0)?, chunk.output::<f32>(0)?)
//! });
//! let first = y[0];
//! run.await?;
//! # Ok(()) }
//! ```
//!
//! A [`Loader`](crate::Loader) borrows its source for its whole life: the
//! rows can't be written while it may still gather them (a batch would mix
//! old and new rows).
//! ```compile_fail,E0502
//! # fn f(device: &gpufeed::Device) -> gpufeed::Result<()> {
//! let mut data = vec![1.0f32; 1024];
//! let rows = gpufeed::RowSource::new(&data, 16)?;
//! let loader = gpufeed::Loader::<f32>::new(device, vec![rows], gpufeed::LoaderConfig::new(4))?;
//! data[0] = 2.0;
//! drop(loader);
//! # Ok(()) }
//! ```
//! Nor can it outlive them:
//! ```compile_fail,E0597
//! # fn f(device: &gpufeed::Device) -> gpufeed::Result<()> {
//! let loader = {
//!     let data = vec![1.0f32; 1024];
//!     let rows = gpufeed::RowSource::new(&data, 16)?;
//!     gpufeed::Loader::<f32>::new(device, vec![rows], gpufeed::LoaderConfig::new(4))?
//! };
//! # drop(loader); Ok(()) }
//! ```
//! A source pinned in place ([`RowSource::registered`](crate::RowSource::registered),
//! gathered by the GPU where it is) is shared: while any row source or
//! loader holds it, nobody can write it (the GPU would gather torn rows).
//! ```compile_fail,E0596
//! # fn f(device: &gpufeed::Device) -> gpufeed::Result<()> {
//! let pinned = std::sync::Arc::new(gpufeed::Registered::new(device, vec![1.0f32; 1024])?);
//! let rows = gpufeed::RowSource::registered(pinned.clone(), 16)?;
//! let loader = gpufeed::Loader::<f32>::new(device, vec![rows], gpufeed::LoaderConfig::new(4))?;
//! pinned.as_mut_slice()[0] = 2.0;
//! # drop(loader); Ok(()) }
//! ```
