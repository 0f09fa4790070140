//! `host staging`: ordinary (pageable) memory to the device and back, by
//! four routes, against size: the driver's own pageable copy, pinning in
//! place then copying (register, copy, unregister), the staging engine
//! (forced through its ring, and its automatic choice), and the pinned copy
//! the link allows. Then the engine's shape swept at one size (threads,
//! block size, blocks), which is where its defaults come from.
//!
//! Every run is checked, every element: runs alternate between two random
//! sources that differ in every word, so a destination still holding the
//! run before's data (an element skipped) is caught, and host destinations
//! are poisoned before each run.
//!
//! The routes of one size and direction take turns run by run, each run's
//! order shuffled (seeded), so a change in the machine's speed during the
//! measurement (this VM's staged figures swing by up to half between runs)
//! falls on every route alike rather than on whichever ran then, and no
//! route always follows the same other one (whose after-effects, a
//! staged copy's workers and caches say, it would then always inherit).
//!
//! The module's files, by job: [`config`] the sizes, runs and routes;
//! [`data`] the checked data (sources, buffers, the check); [`case`] one
//! route's timed and checked runs; [`routes`] the routes themselves and the
//! table of every size; [`slices`] the pipeline over ordinary memory;
//! [`sweep`] the engine's shapes; [`results`] what is kept, and its plot.

mod case;
mod config;
mod data;
mod results;
mod routes;
mod slices;
mod sweep;

pub use config::{Config, Path4};
pub use routes::run;
