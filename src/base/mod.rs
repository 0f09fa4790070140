//! The lowest floor: what every other part stands on and which knows nothing of
//! devices: the completion core (a future completed once, from any thread),
//! `block_on` and its spin policy, the worker pool, claims, fork detection,
//! NUMA placement and the error types.

pub(crate) mod block;
pub(crate) mod claim;
pub(crate) mod completion;
pub(crate) mod error;
pub(crate) mod fork;
pub(crate) mod numa;
pub(crate) mod workers;
