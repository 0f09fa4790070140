//! The overlap pipeline: a host array pushed through host-to-device copy,
//! kernel and device-to-host copy in chunks over several streams, so the two
//! copy engines and the SMs work at the same time.
//!
//! ```text
//! stream 0: [H2D c0][K c0][D2H c0]            [H2D c4][K c4][D2H c4] ...
//! stream 1:         [H2D c1][K c1][D2H c1]            [H2D c5] ...
//! stream 2:                 [H2D c2][K c2][D2H c2]
//! ```
//!
//! Each stream reuses one chunk-sized device buffer; its stream order makes
//! that safe (chunk `i + S` is copied in only after chunk `i` was copied out).
//!
//! The *engines* layout ([`Plan::engines`]) instead gives each engine its own
//! stream: every host-to-device copy goes on a copy-in stream, every kernel on
//! a compute stream, every device-to-host copy on a copy-out stream, linked by
//! events, with a ring of device buffers:
//!
//! ```text
//! copy-in:  [H2D c0][H2D c1][H2D c2][H2D c3]...   (waits: c_i+R for D2H c_i)
//! compute:          [K c0]  [K c1]  [K c2]  ...   (waits: H2D c_i)
//! copy-out:              [D2H c0][D2H c1][D2H c2] (waits: K c_i)
//! ```
//!
//! Copies of one direction then never share the link with each other, so the
//! first chunk arrives at full speed and the pipeline fills sooner.
//!
//! Consecutive runs on one pipeline are ordered on the GPU: every stream of a
//! run first waits for the end of the previous run, so device scratch is never
//! written by one run while another still reads it, whatever their layouts.
//! A run is one [`Job`](crate::runtime::stream::Job) owning the input, the
//! output and the device buffers until the last stream is done, so dropping
//! it early frees nothing in use.
//!
//! The module's files, by job: [`plan`] cuts a run into chunks and lays them
//! over streams; [`timeline`] holds what a run reports; [`arrays`] the host
//! arrays a run copies; [`chunk`] what a stage sees of one chunk and where it
//! lives on the device; [`pipe`] the [`Pipeline`] and its public runs;
//! [`run`] a run's checks, lock, enqueueing and end; [`enqueue`] the two
//! layouts' chunk by chunk enqueueing.

mod arrays;
mod chunk;
mod enqueue;
mod pipe;
mod plan;
mod run;
mod timeline;

pub use arrays::{Arrays, KeepAlive, PinnedArray};
pub use chunk::Chunk;
pub use pipe::{Pipeline, MAX_STREAMS};
pub use plan::{Layout, Plan, AUTO_CHUNK_COST_BYTES};
pub use timeline::{ChunkEvents, RunInfo, Timeline};
