//! Device memory of another library, imported (through DLPack or the CUDA
//! array interface): what an import yields, and the layout both importers
//! accept.

use crate::convert::buffer_error;
use crate::dtype::DType;
use pyo3::prelude::*;

/// What importing foreign device memory yields.
pub struct Imported {
    pub addr: u64,
    pub shape: Vec<usize>,
    pub dtype: DType,
    pub owner: Py<PyAny>,
}

/// `BufferError` unless `strides` (bytes) are C-contiguous for `shape`.
pub fn check_c_contiguous(shape: &[usize], strides: &[isize], item: usize) -> PyResult<()> {
    let mut expect = item as isize;
    for (&d, &s) in shape.iter().zip(strides).rev() {
        if d > 1 && s != expect {
            return Err(buffer_error(format!(
                "the array is not C-contiguous (shape {shape:?}, strides {strides:?})"
            )));
        }
        expect *= d as isize;
    }
    Ok(())
}
