//! `Device` (a backend, shared per backend and ordinal) and `DeviceArray`
//! (device memory: our own, or a PyTorch/CuPy allocation wrapped in place).

//!
//! The module's files, by job: `devices` the `Device` objects (one per
//! backend and ordinal) and the default device; `parse` shapes and
//! dtypes given from Python; `state` the memory an array holds and the
//! state it is in (ready, taken by an operation, freed); `array` the
//! `DeviceArray` and its checks; `methods` its Python methods and
//! exports; `import` foreign CUDA arrays wrapped in place.

mod array;
mod devices;
mod import;
mod methods;
mod parse;
mod state;

pub use array::DeviceArray;
pub use devices::{default_device, device_or_default, Device};
pub use import::as_device_array;
pub use parse::{nbytes, parse_dtype, parse_dtype_or_f32, parse_shape};
pub use state::{DevMem, State, StateCell};
