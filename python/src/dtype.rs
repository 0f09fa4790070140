//! Element types: names, buffer-protocol formats, DLPack codes.

use std::ffi::CStr;

/// An element type of a buffer. The memory is bytes underneath; the type
/// says how Python sees it and which kernels accept it (float32 only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F32,
    F64,
    F16,
    BF16,
    I8,
    I16,
    I32,
    I64,
    U8,
    U16,
    U32,
    U64,
}

/// Every type, for parsing.
pub const ALL: [DType; 12] = [
    DType::F32,
    DType::F64,
    DType::F16,
    DType::BF16,
    DType::I8,
    DType::I16,
    DType::I32,
    DType::I64,
    DType::U8,
    DType::U16,
    DType::U32,
    DType::U64,
];

impl DType {
    /// The NumPy dtype that holds its values: its own, and `uint16` for
    /// bfloat16, which NumPy lacks (the same two bytes per value).
    pub fn numpy_name(self) -> &'static str {
        if self == DType::BF16 {
            "uint16"
        } else {
            self.name()
        }
    }

    /// NumPy's name (`float32`, ...; `bfloat16` as ml_dtypes and PyTorch call it).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::I8 => "int8",
            DType::I16 => "int16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::U8 => "uint8",
            DType::U16 => "uint16",
            DType::U32 => "uint32",
            DType::U64 => "uint64",
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::I8 | DType::U8 => 1,
            DType::F16 | DType::BF16 | DType::I16 | DType::U16 => 2,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F64 | DType::I64 | DType::U64 => 8,
        }
    }

    /// The buffer-protocol (struct module) format. bfloat16 has none: it is
    /// exported as its raw bits, `uint16` (`H`).
    pub fn format(self) -> &'static CStr {
        match self {
            DType::F32 => c"f",
            DType::F64 => c"d",
            DType::F16 => c"e",
            DType::BF16 | DType::U16 => c"H",
            DType::I8 => c"b",
            DType::I16 => c"h",
            DType::I32 => c"i",
            DType::I64 => c"q",
            DType::U8 => c"B",
            DType::U32 => c"I",
            DType::U64 => c"Q",
        }
    }

    /// DLPack `(code, bits)`: kDLInt 0, kDLUInt 1, kDLFloat 2, kDLBfloat 4.
    pub fn dlpack(self) -> (u8, u8) {
        let bits = (self.size() * 8) as u8;
        let code = match self {
            DType::F32 | DType::F64 | DType::F16 => 2,
            DType::BF16 => 4,
            DType::I8 | DType::I16 | DType::I32 | DType::I64 => 0,
            DType::U8 | DType::U16 | DType::U32 | DType::U64 => 1,
        };
        (code, bits)
    }

    /// The `__cuda_array_interface__` type string (little-endian).
    pub fn typestr(self) -> &'static str {
        match self {
            DType::F32 => "<f4",
            DType::F64 => "<f8",
            DType::F16 => "<f2",
            DType::BF16 | DType::U16 => "<u2",
            DType::I8 => "|i1",
            DType::I16 => "<i2",
            DType::I32 => "<i4",
            DType::I64 => "<i8",
            DType::U8 => "|u1",
            DType::U32 => "<u4",
            DType::U64 => "<u8",
        }
    }

    /// From a name: NumPy's (`float32`, `f4`, `<f4`), PyTorch's
    /// (`torch.float32`; `torch.float` and `torch.int` are 32-bit, as
    /// PyTorch's aliases), the C-ish ones (`double`, `half`); `float` and
    /// `int` (and the builtin types) are 64-bit, as NumPy reads them.
    pub fn parse(name: &str) -> Option<DType> {
        let n = name.trim();
        let n = match n.strip_prefix("torch.") {
            Some("float") => return Some(DType::F32),
            Some("int") => return Some(DType::I32),
            Some(t) => t,
            None => n,
        };
        let n = n
            .strip_prefix("dtype('")
            .and_then(|s| s.strip_suffix("')"))
            .unwrap_or(n);
        let n = n.trim_start_matches(['<', '=', '|']);
        Some(match n {
            // "float" and "int" (and the builtin types, by their names) as
            // NumPy reads them: 64 bits, never narrowed.
            "float32" | "f4" | "f" => DType::F32,
            "float64" | "f8" | "d" | "double" | "float" => DType::F64,
            "float16" | "f2" | "e" | "half" => DType::F16,
            "bfloat16" => DType::BF16,
            "int8" | "i1" | "b" => DType::I8,
            "int16" | "i2" | "h" | "short" => DType::I16,
            "int32" | "i4" | "i" => DType::I32,
            "int64" | "i8" | "q" | "long" | "l" | "int" => DType::I64,
            "uint8" | "u1" | "B" => DType::U8,
            "uint16" | "u2" | "H" => DType::U16,
            "uint32" | "u4" | "I" => DType::U32,
            "uint64" | "u8" | "Q" | "L" => DType::U64,
            _ => return None,
        })
    }

    /// From a buffer-protocol format string (`f`, `<f`, `=f`, `@f`; big-endian
    /// `>`/`!` and anything else are refused).
    pub fn from_format(format: &str) -> Option<DType> {
        let f = format.trim_start_matches(['<', '=', '@']);
        if f.len() != 1 {
            return None;
        }
        Some(match f {
            "f" => DType::F32,
            "d" => DType::F64,
            "e" => DType::F16,
            "b" => DType::I8,
            "h" => DType::I16,
            "i" => DType::I32,
            "q" => DType::I64,
            // `l`/`L` are 8 bytes on the 64-bit Linux this runs on; checked
            // against the itemsize by the caller.
            "l" => DType::I64,
            "B" => DType::U8,
            "H" => DType::U16,
            "I" => DType::U32,
            "Q" | "L" => DType::U64,
            _ => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for d in ALL {
            assert_eq!(DType::parse(d.name()), Some(d), "{d:?}");
            assert_eq!(d.dlpack().1 as usize, d.size() * 8);
        }
        assert_eq!(DType::parse("torch.float32"), Some(DType::F32));
        // PyTorch's aliases are its own: 32-bit; NumPy's names 64-bit.
        assert_eq!(DType::parse("torch.float"), Some(DType::F32));
        assert_eq!(DType::parse("torch.int"), Some(DType::I32));
        assert_eq!(DType::parse("torch.double"), Some(DType::F64));
        assert_eq!(DType::parse("torch.long"), Some(DType::I64));
        assert_eq!(DType::parse("float"), Some(DType::F64));
        assert_eq!(DType::parse("int"), Some(DType::I64));
        assert_eq!(DType::parse("<f4"), Some(DType::F32));
        assert_eq!(DType::parse("complex64"), None);
    }

    #[test]
    fn formats_map_back_except_bfloat16() {
        for d in ALL {
            let f = d.format().to_str().unwrap_or_default();
            let back = DType::from_format(f);
            if d == DType::BF16 {
                assert_eq!(back, Some(DType::U16));
            } else {
                assert_eq!(back, Some(d), "{d:?}");
            }
        }
        assert_eq!(DType::from_format("<f"), Some(DType::F32));
        assert_eq!(DType::from_format(">f"), None);
        assert_eq!(DType::from_format("2f"), None);
    }
}
