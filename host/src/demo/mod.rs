//! The demonstration's parts; each is a subcommand.

pub mod kernels;
pub mod ptx;
pub mod report;
