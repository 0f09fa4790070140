//! Shapes and dtypes as Python gives them, checked, and the bytes they
//! make.

use crate::dtype::DType;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

/// A shape: an int or a sequence of ints.
pub fn parse_shape(shape: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
    // An int (anything with `__index__`), or a sequence of them; a
    // negative or too large dimension is a `ValueError`, an exception the
    // object's own `__index__` raises propagates as it is.
    let dims: Vec<Bound<'_, PyAny>> = if shape.hasattr("__index__")? {
        vec![shape.clone()]
    } else if shape.is_instance_of::<pyo3::types::PyString>() {
        return Err(PyTypeError::new_err(
            "shape must be an int or a sequence of ints, not a str",
        ));
    } else {
        shape
            .try_iter()
            .map_err(|_| PyTypeError::new_err("shape must be an int or a sequence of ints"))?
            .collect::<PyResult<_>>()?
    };
    dims.iter()
        .map(|d| d.extract::<crate::convert::Count>().map(|c| c.0 as usize))
        .collect()
}

/// A dtype: a name (`"float32"`, `"f4"`), a NumPy dtype or type, a PyTorch dtype.
pub fn parse_dtype(dtype: &Bound<'_, PyAny>) -> PyResult<DType> {
    // A NumPy dtype of the other byte order reads as "float32" by name, but
    // its bytes are not ours: refused rather than misread.
    if let Ok(native) = dtype.getattr("isnative").and_then(|n| n.extract::<bool>()) {
        if !native {
            return Err(PyTypeError::new_err(format!(
                "unsupported dtype {}: not in the machine's byte order (use .newbyteorder('=') \
                 on the data, or astype of a native dtype)",
                dtype.repr().map(|r| r.to_string()).unwrap_or_default()
            )));
        }
    }
    let mut names = Vec::new();
    if let Ok(s) = dtype.extract::<String>() {
        names.push(s);
    } else {
        if let Ok(n) = dtype.getattr("name").and_then(|n| n.extract::<String>()) {
            names.push(n);
        }
        if let Ok(n) = dtype
            .getattr("__name__")
            .and_then(|n| n.extract::<String>())
        {
            names.push(n);
        }
        if let Ok(s) = dtype.str() {
            names.push(s.to_string());
        }
    }
    names.iter().find_map(|n| DType::parse(n)).ok_or_else(|| {
        PyTypeError::new_err(format!(
            "unsupported dtype {}: use one of {}",
            dtype.repr().map(|r| r.to_string()).unwrap_or_default(),
            crate::dtype::ALL
                .iter()
                .map(|d| d.name())
                .collect::<Vec<_>>()
                .join(", ")
        ))
    })
}

/// A dtype, float32 when None.
pub fn parse_dtype_or_f32(dtype: Option<&Bound<'_, PyAny>>) -> PyResult<DType> {
    dtype.map_or(Ok(DType::F32), parse_dtype)
}

/// Bytes of `shape` of `dtype`, or an error. The strides must fit too
/// (the product of the non-zero dimensions, in bytes, within `isize`), even
/// when a zero dimension makes the array empty.
pub fn nbytes(shape: &[usize], dtype: DType) -> PyResult<usize> {
    let fits = |skip_zeros: bool| {
        shape
            .iter()
            .filter(|&&d| !skip_zeros || d > 0)
            .try_fold(dtype.size(), |acc, &d| acc.checked_mul(d))
            .filter(|&b| b <= isize::MAX as usize)
    };
    let overflow =
        || PyValueError::new_err(format!("shape {shape:?} of {} overflows", dtype.name()));
    fits(true).ok_or_else(overflow)?;
    fits(false).ok_or_else(overflow)
}
