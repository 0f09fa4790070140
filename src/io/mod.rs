//! File input below the engines: `O_DIRECT` reads and writes and the
//! GPUDirect Storage probe.

pub(crate) mod direct_io;
pub(crate) mod gds;
