//! The safetensors format: an 8-byte little-endian header length, a JSON
//! header (each tensor's `dtype`, `shape` and `data_offsets` within the
//! data region after the header; `__metadata__` a map of strings), the
//! data. Read here with every entry checked against the file before any
//! tensor byte is read; written with the format's own padding (spaces to 8
//! bytes).

use super::error::FileError;
use super::json::{quote, Json};
use crate::base::error::Result;
use std::io::ErrorKind;
use std::path::Path;

/// A tensor's element type, as safetensors names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// `BOOL` (one byte).
    Bool,
    /// `U8`.
    U8,
    /// `I8`.
    I8,
    /// `F8_E5M2`.
    F8E5M2,
    /// `F8_E4M3`.
    F8E4M3,
    /// `I16`.
    I16,
    /// `U16`.
    U16,
    /// `F16`.
    F16,
    /// `BF16`.
    BF16,
    /// `I32`.
    I32,
    /// `U32`.
    U32,
    /// `F32`.
    F32,
    /// `F64`.
    F64,
    /// `I64`.
    I64,
    /// `U64`.
    U64,
}

impl Dtype {
    /// Every dtype.
    pub const ALL: [Dtype; 15] = [
        Dtype::Bool,
        Dtype::U8,
        Dtype::I8,
        Dtype::F8E5M2,
        Dtype::F8E4M3,
        Dtype::I16,
        Dtype::U16,
        Dtype::F16,
        Dtype::BF16,
        Dtype::I32,
        Dtype::U32,
        Dtype::F32,
        Dtype::F64,
        Dtype::I64,
        Dtype::U64,
    ];

    /// The name in a safetensors header (`"BF16"`).
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bool => "BOOL",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::F8E5M2 => "F8_E5M2",
            Dtype::F8E4M3 => "F8_E4M3",
            Dtype::I16 => "I16",
            Dtype::U16 => "U16",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::I32 => "I32",
            Dtype::U32 => "U32",
            Dtype::F32 => "F32",
            Dtype::F64 => "F64",
            Dtype::I64 => "I64",
            Dtype::U64 => "U64",
        }
    }

    /// The dtype of a header name.
    pub fn from_name(name: &str) -> Option<Dtype> {
        Dtype::ALL.into_iter().find(|d| d.name() == name)
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::Bool | Dtype::U8 | Dtype::I8 | Dtype::F8E5M2 | Dtype::F8E4M3 => 1,
            Dtype::I16 | Dtype::U16 | Dtype::F16 | Dtype::BF16 => 2,
            Dtype::I32 | Dtype::U32 | Dtype::F32 => 4,
            Dtype::F64 | Dtype::I64 | Dtype::U64 => 8,
        }
    }
}

/// One tensor of a safetensors file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorEntry {
    /// Its name.
    pub name: String,
    /// Its element type.
    pub dtype: Dtype,
    /// Its shape (row-major, C order).
    pub shape: Vec<usize>,
    /// File offset of its first byte.
    pub at: u64,
    /// Its size in bytes.
    pub nbytes: u64,
}

/// A safetensors file's header, checked against the file.
#[derive(Clone, Debug)]
pub struct Header {
    /// The tensors, in the header's order.
    pub tensors: Vec<TensorEntry>,
    /// `__metadata__`, in the header's order.
    pub metadata: Vec<(String, String)>,
    /// File offset of the data region.
    pub data_start: u64,
    /// The file's length when read.
    pub file_len: u64,
}

/// Headers past this many bytes are refused (the safetensors package's
/// own bound).
pub const MAX_HEADER_BYTES: u64 = 100 << 20;

/// Reads and checks the header of the safetensors file `path`: every
/// tensor's dtype known, its offsets spanning its shape's bytes, inside the
/// file, and shared with no other tensor.
///
/// # Errors
/// [`crate::base::error::Error::Io`] carrying a [`FileError`] that names the file: the
/// system's error opening it (`NotFound`...); `InvalidData` for a file that
/// is not safetensors (length, UTF-8, JSON, fields, overlaps); `UnexpectedEof`
/// for a file shorter than its header says (a tensor's bytes short).
pub fn read_header(path: &Path) -> Result<Header> {
    use std::io::Read;
    let bad = |why: String| {
        FileError::error(
            path,
            ErrorKind::InvalidData,
            format!("not a safetensors file: {why}"),
        )
    };
    let mut file = std::fs::File::open(path).map_err(|e| FileError::io(path, e))?;
    let meta = file.metadata().map_err(|e| FileError::io(path, e))?;
    if meta.is_dir() {
        return Err(FileError::io(
            path,
            std::io::Error::from_raw_os_error(libc::EISDIR),
        ));
    }
    let size = meta.len();
    let mut n = [0u8; 8];
    file.read_exact(&mut n)
        .map_err(|_| bad("shorter than its 8-byte header length".into()))?;
    let n = u64::from_le_bytes(n);
    if n > MAX_HEADER_BYTES || 8 + n > size {
        return Err(bad(format!(
            "header length {n} does not fit the file ({size} bytes)"
        )));
    }
    let mut text = vec![0u8; n as usize];
    file.read_exact(&mut text)
        .map_err(|_| bad("header cut short".into()))?;
    let text = String::from_utf8(text).map_err(|_| bad("header is not UTF-8".into()))?;
    let json = Json::parse(&text).map_err(|e| bad(format!("header is not JSON: {e}")))?;
    let Json::Obj(members) = json else {
        return Err(bad("header is not a JSON object".into()));
    };
    let data_start = 8 + n;
    let mut tensors = Vec::with_capacity(members.len());
    let mut metadata = Vec::new();
    let mut spans = Vec::new();
    for (name, meta) in members {
        if name == "__metadata__" {
            let Json::Obj(m) = meta else {
                return Err(bad("__metadata__ is not an object of strings".into()));
            };
            for (k, v) in m {
                let Some(v) = v.as_str() else {
                    return Err(bad(format!("__metadata__[{k:?}] is not a string")));
                };
                metadata.push((k, v.to_string()));
            }
            continue;
        }
        let field = |k: &str| {
            meta.get(k)
                .ok_or_else(|| bad(format!("tensor {name:?} has no {k:?}")))
        };
        let dtype_name = field("dtype")?
            .as_str()
            .ok_or_else(|| bad(format!("tensor {name:?}: dtype is not a string")))?;
        let dtype = Dtype::from_name(dtype_name)
            .ok_or_else(|| bad(format!("tensor {name:?}: unknown dtype {dtype_name:?}")))?;
        let shape: Vec<usize> = match field("shape")? {
            Json::Arr(dims) => dims
                .iter()
                .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
                .collect::<Option<_>>()
                .ok_or_else(|| bad(format!("tensor {name:?}: shape is not a list of sizes")))?,
            _ => {
                return Err(bad(format!(
                    "tensor {name:?}: shape is not a list of sizes"
                )))
            }
        };
        let offsets: Option<Vec<u64>> = match field("data_offsets")? {
            Json::Arr(o) => o.iter().map(Json::as_u64).collect(),
            _ => None,
        };
        let Some([begin, end]) = offsets
            .as_deref()
            .and_then(|o| <[u64; 2]>::try_from(o).ok())
        else {
            return Err(bad(format!(
                "tensor {name:?}: data_offsets is not [begin, end]"
            )));
        };
        let nbytes = shape
            .iter()
            .try_fold(dtype.size() as u64, |a, &d| a.checked_mul(d as u64))
            .ok_or_else(|| bad(format!("tensor {name:?}: size overflows")))?;
        if end < begin || end - begin != nbytes {
            return Err(bad(format!(
                "tensor {name:?}: data_offsets [{begin}, {end}] do not span its {nbytes} bytes"
            )));
        }
        let Some(ends_at) = data_start.checked_add(end) else {
            return Err(bad(format!(
                "tensor {name:?}: data_offsets [{begin}, {end}] lie past 2**64 bytes"
            )));
        };
        if ends_at > size {
            return Err(FileError::error(
                path,
                ErrorKind::UnexpectedEof,
                format!(
                    "the file is cut short: its header puts tensor {name:?} at data_offsets \
                     [{begin}, {end}] after a {data_start}-byte header, the file has {size} bytes"
                ),
            ));
        }
        if end > begin {
            spans.push((begin, end, tensors.len()));
        }
        tensors.push(TensorEntry {
            name,
            dtype,
            shape,
            at: data_start + begin,
            nbytes,
        });
    }
    spans.sort_unstable();
    if let Some(w) = spans.windows(2).find(|w| w[1].0 < w[0].1) {
        return Err(bad(format!(
            "tensors {:?} and {:?} overlap",
            tensors[w[0].2].name, tensors[w[1].2].name
        )));
    }
    Ok(Header {
        tensors,
        metadata,
        data_start,
        file_len: size,
    })
}

/// The bytes before the data of a safetensors file holding `tensors` (name,
/// dtype, shape, each after the one before) and `metadata`: the 8-byte
/// length and the JSON header, padded with spaces to a multiple of 8.
pub fn header_bytes(tensors: &[(&str, Dtype, &[usize])], metadata: &[(String, String)]) -> Vec<u8> {
    let mut text = String::from("{");
    if !metadata.is_empty() {
        text.push_str("\"__metadata__\":{");
        for (i, (k, v)) in metadata.iter().enumerate() {
            if i > 0 {
                text.push(',');
            }
            text.push_str(&quote(k));
            text.push(':');
            text.push_str(&quote(v));
        }
        text.push('}');
    }
    let mut pos = 0u64;
    for (i, (name, dtype, shape)) in tensors.iter().enumerate() {
        if i > 0 || !metadata.is_empty() {
            text.push(',');
        }
        let nbytes = shape
            .iter()
            .fold(dtype.size() as u64, |a, &d| a.saturating_mul(d as u64));
        let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
        text.push_str(&format!(
            "{}:{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{},{}]}}",
            quote(name),
            dtype.name(),
            dims.join(","),
            pos,
            pos + nbytes
        ));
        pos += nbytes;
    }
    text.push('}');
    let mut head = text.into_bytes();
    head.resize(head.len().next_multiple_of(8), b' ');
    let mut out = (head.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&head);
    out
}

#[cfg(test)]
mod tests {
    use super::{header_bytes, read_header, Dtype};
    use std::io::Write;

    fn write(name: &str, bytes: &[u8]) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("gpufeed-st-{}-{name}", std::process::id()));
        let mut f = std::fs::File::create(&dir).unwrap();
        f.write_all(bytes).unwrap();
        dir
    }

    #[test]
    fn a_written_header_reads_back() {
        let shape_a = [2usize, 3];
        let shape_b = [5usize];
        let meta = vec![("format".to_string(), "pt".to_string())];
        let mut bytes = header_bytes(
            &[("a", Dtype::F32, &shape_a), ("b\"q", Dtype::BF16, &shape_b)],
            &meta,
        );
        assert_eq!(bytes.len() % 8, 0);
        let start = bytes.len() as u64;
        bytes.extend(std::iter::repeat_n(7u8, 24 + 10));
        let p = write("rt", &bytes);
        let h = read_header(&p).unwrap();
        assert_eq!(h.metadata, meta);
        assert_eq!(h.data_start, start);
        assert_eq!(h.tensors[0].name, "a");
        assert_eq!((h.tensors[0].at, h.tensors[0].nbytes), (start, 24));
        assert_eq!(h.tensors[1].name, "b\"q");
        assert_eq!((h.tensors[1].at, h.tensors[1].nbytes), (start + 24, 10));
        // Cut short: a tensor's bytes missing.
        std::fs::write(&p, &bytes[..bytes.len() - 1]).unwrap();
        let e = read_header(&p).unwrap_err().to_string();
        assert!(e.contains("cut short") && e.contains("gpufeed-st-"), "{e}");
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn files_that_are_not_safetensors_are_refused_naming_the_file() {
        for (i, bytes) in [
            b"short".to_vec(),
            [&8u64.to_le_bytes()[..], b"notjson!"].concat(),
            [&2u64.to_le_bytes()[..], b"[]"].concat(),
            [&u64::MAX.to_le_bytes()[..], b"{}"].concat(),
        ]
        .iter()
        .enumerate()
        {
            let p = write(&format!("bad{i}"), bytes);
            let e = read_header(&p).unwrap_err();
            let text = e.to_string();
            assert!(text.contains("not a safetensors file"), "{text}");
            assert!(text.contains(&p.display().to_string()), "{text}");
            std::fs::remove_file(&p).unwrap();
        }
    }
}
