//! A GGUF (v2/v3) reader over a memory map.
//!
//! The header, the metadata and the tensor infos are parsed eagerly (with every length checked
//! against the file size before anything is allocated from it); tensor data stays in the mapping
//! and is handed out as [`WeightBytes`] without a copy.
//!
//! Layout (little-endian): magic `GGUF`, version u32, tensor count u64, metadata count u64, the
//! metadata key/value pairs, the tensor infos (name, n_dims u32, dims u64 × n_dims with ne\[0\]
//! the contiguous one, ggml type u32, offset u64 relative to the data section), padding up to
//! `general.alignment` (default 32), then the data section.

use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use crate::quant_type::QuantType;
use crate::storage::WeightBytes;

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml's GGML_MAX_DIMS.
const MAX_DIMS: u32 = 4;
/// Nested arrays deeper than this are rejected (no real file nests more than 2).
const MAX_ARRAY_DEPTH: usize = 8;
/// Longest key / tensor name accepted (llama.cpp uses 64 for names; be generous).
const MAX_NAME_LEN: u64 = 65_536;

/// Everything that can be wrong with a GGUF file.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{path}: cannot read GGUF file: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a GGUF file (magic {found:02x?}, expected \"GGUF\")")]
    BadMagic { path: PathBuf, found: [u8; 4] },
    #[error("{path}: unsupported GGUF version {version} (supported: 2, 3){hint}")]
    UnsupportedVersion {
        path: PathBuf,
        version: u32,
        hint: &'static str,
    },
    #[error(
        "{path}: truncated GGUF file: {what} needs {needed} bytes at offset {offset}, file is {file_len} bytes"
    )]
    Truncated {
        path: PathBuf,
        what: String,
        offset: u64,
        needed: u64,
        file_len: u64,
    },
    #[error("{path}: implausible {what}: {count} (the file is only {file_len} bytes)")]
    AbsurdCount {
        path: PathBuf,
        what: String,
        count: u64,
        file_len: u64,
    },
    #[error("{path}: metadata key {key:?}: unknown value type {type_id}")]
    UnknownValueType {
        path: PathBuf,
        key: String,
        type_id: u32,
    },
    #[error("{path}: metadata key {key:?}: arrays nested deeper than {MAX_ARRAY_DEPTH}")]
    TooDeep { path: PathBuf, key: String },
    #[error("{path}: {what} is not valid UTF-8")]
    BadUtf8 { path: PathBuf, what: String },
    #[error("{path}: duplicate {what} {name:?}")]
    Duplicate {
        path: PathBuf,
        what: &'static str,
        name: String,
    },
    #[error("{path}: general.alignment = {alignment} is not a non-zero power of two")]
    BadAlignment { path: PathBuf, alignment: u64 },
    #[error("{path}: tensor {name:?}: {n_dims} dimensions (at most {MAX_DIMS} supported)")]
    TooManyDims {
        path: PathBuf,
        name: String,
        n_dims: u32,
    },
    #[error("{path}: tensor {name:?}: bad shape {dims:?}: {why}")]
    BadShape {
        path: PathBuf,
        name: String,
        dims: Vec<u64>,
        why: String,
    },
    #[error(
        "{path}: tensor {name:?}: unsupported tensor type {type_id} ({type_name}); supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K"
    )]
    UnsupportedTensorType {
        path: PathBuf,
        name: String,
        type_id: u32,
        type_name: &'static str,
    },
    #[error(
        "{path}: tensor {name:?}: offset {offset} is not a multiple of the alignment {alignment}"
    )]
    MisalignedTensor {
        path: PathBuf,
        name: String,
        offset: u64,
        alignment: u64,
    },
    #[error(
        "{path}: tensor {name:?}: data [{start}, {end}) runs past the end of the file ({file_len} bytes)"
    )]
    TensorPastEnd {
        path: PathBuf,
        name: String,
        start: u64,
        end: u64,
        file_len: u64,
    },
    #[error("{path}: metadata key {key:?} is missing")]
    MissingKey { path: PathBuf, key: String },
    #[error("{path}: metadata key {key:?} has type {found}, expected {expected}")]
    WrongType {
        path: PathBuf,
        key: String,
        expected: &'static str,
        found: String,
    },
    #[error("{path}: no tensor named {name:?}")]
    NoSuchTensor { path: PathBuf, name: String },
}

/// The GGUF metadata value types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    String,
    Array,
    U64,
    I64,
    F64,
}

impl GgufType {
    pub fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => Self::U8,
            1 => Self::I8,
            2 => Self::U16,
            3 => Self::I16,
            4 => Self::U32,
            5 => Self::I32,
            6 => Self::F32,
            7 => Self::Bool,
            8 => Self::String,
            9 => Self::Array,
            10 => Self::U64,
            11 => Self::I64,
            12 => Self::F64,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::U8 => "u8",
            Self::I8 => "i8",
            Self::U16 => "u16",
            Self::I16 => "i16",
            Self::U32 => "u32",
            Self::I32 => "i32",
            Self::F32 => "f32",
            Self::Bool => "bool",
            Self::String => "string",
            Self::Array => "array",
            Self::U64 => "u64",
            Self::I64 => "i64",
            Self::F64 => "f64",
        }
    }

    /// The fewest bytes one value of this type occupies in the file (used to bound counts).
    fn min_size(self) -> u64 {
        match self {
            Self::U8 | Self::I8 | Self::Bool => 1,
            Self::U16 | Self::I16 => 2,
            Self::U32 | Self::I32 | Self::F32 => 4,
            Self::U64 | Self::I64 | Self::F64 | Self::String => 8,
            Self::Array => 12,
        }
    }
}

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(GgufArray),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// A metadata array, stored typed (a 49k-entry token list is one `Vec<String>`).
#[derive(Debug, Clone, PartialEq)]
pub enum GgufArray {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    String(Vec<String>),
    Array(Vec<GgufArray>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
}

impl GgufArray {
    pub fn len(&self) -> usize {
        match self {
            Self::U8(v) => v.len(),
            Self::I8(v) => v.len(),
            Self::U16(v) => v.len(),
            Self::I16(v) => v.len(),
            Self::U32(v) => v.len(),
            Self::I32(v) => v.len(),
            Self::F32(v) => v.len(),
            Self::Bool(v) => v.len(),
            Self::String(v) => v.len(),
            Self::Array(v) => v.len(),
            Self::U64(v) => v.len(),
            Self::I64(v) => v.len(),
            Self::F64(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn elem_type(&self) -> GgufType {
        match self {
            Self::U8(_) => GgufType::U8,
            Self::I8(_) => GgufType::I8,
            Self::U16(_) => GgufType::U16,
            Self::I16(_) => GgufType::I16,
            Self::U32(_) => GgufType::U32,
            Self::I32(_) => GgufType::I32,
            Self::F32(_) => GgufType::F32,
            Self::Bool(_) => GgufType::Bool,
            Self::String(_) => GgufType::String,
            Self::Array(_) => GgufType::Array,
            Self::U64(_) => GgufType::U64,
            Self::I64(_) => GgufType::I64,
            Self::F64(_) => GgufType::F64,
        }
    }

    /// All elements as i64 when the element type is an integer type (u64 values above i64::MAX
    /// are not representable and give `None`).
    pub fn to_i64_vec(&self) -> Option<Vec<i64>> {
        Some(match self {
            Self::U8(v) => v.iter().map(|&x| x as i64).collect(),
            Self::I8(v) => v.iter().map(|&x| x as i64).collect(),
            Self::U16(v) => v.iter().map(|&x| x as i64).collect(),
            Self::I16(v) => v.iter().map(|&x| x as i64).collect(),
            Self::U32(v) => v.iter().map(|&x| x as i64).collect(),
            Self::I32(v) => v.iter().map(|&x| x as i64).collect(),
            Self::I64(v) => v.clone(),
            Self::U64(v) => v
                .iter()
                .map(|&x| i64::try_from(x).ok())
                .collect::<Option<_>>()?,
            _ => return None,
        })
    }
}

impl GgufValue {
    pub fn type_name(&self) -> String {
        match self {
            Self::Array(a) => format!("array of {}", a.elem_type().name()),
            Self::U8(_) => "u8".into(),
            Self::I8(_) => "i8".into(),
            Self::U16(_) => "u16".into(),
            Self::I16(_) => "i16".into(),
            Self::U32(_) => "u32".into(),
            Self::I32(_) => "i32".into(),
            Self::F32(_) => "f32".into(),
            Self::Bool(_) => "bool".into(),
            Self::String(_) => "string".into(),
            Self::U64(_) => "u64".into(),
            Self::I64(_) => "i64".into(),
            Self::F64(_) => "f64".into(),
        }
    }

    /// The value as an i128 when it is any integer type.
    fn as_int(&self) -> Option<i128> {
        Some(match *self {
            Self::U8(x) => x as i128,
            Self::I8(x) => x as i128,
            Self::U16(x) => x as i128,
            Self::I16(x) => x as i128,
            Self::U32(x) => x as i128,
            Self::I32(x) => x as i128,
            Self::U64(x) => x as i128,
            Self::I64(x) => x as i128,
            _ => return None,
        })
    }
}

/// One tensor's description from the header.
#[derive(Debug, Clone)]
pub struct GgufTensorInfo {
    pub name: String,
    /// ggml dims: `dims[0]` is the contiguous one (columns).
    pub dims: Vec<u64>,
    pub ty: QuantType,
    /// Offset relative to the start of the data section.
    pub offset: u64,
    /// Size of the data in bytes.
    pub size: u64,
}

impl GgufTensorInfo {
    /// Columns (ne\[0\]).
    pub fn cols(&self) -> usize {
        self.dims.first().copied().unwrap_or(1) as usize
    }

    /// Rows: the product of ne\[1..\] (1 for a 1-D tensor).
    pub fn rows(&self) -> usize {
        self.dims.iter().skip(1).product::<u64>() as usize
    }
}

/// The name of a ggml tensor type id, for messages.
pub fn ggml_type_name(id: u32) -> &'static str {
    match id {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        4 => "Q4_2 (removed)",
        5 => "Q4_3 (removed)",
        6 => "Q5_0",
        7 => "Q5_1",
        8 => "Q8_0",
        9 => "Q8_1",
        10 => "Q2_K",
        11 => "Q3_K",
        12 => "Q4_K",
        13 => "Q5_K",
        14 => "Q6_K",
        15 => "Q8_K",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        30 => "BF16",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        _ => "unknown",
    }
}

/// A parsed, memory-mapped GGUF file.
pub struct GgufFile {
    path: PathBuf,
    map: Arc<Mmap>,
    version: u32,
    metadata: Vec<(String, GgufValue)>,
    index: HashMap<String, usize>,
    tensors: Vec<GgufTensorInfo>,
    tensor_index: HashMap<String, usize>,
    alignment: u64,
    data_offset: u64,
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("alignment", &self.alignment)
            .field("data_offset", &self.data_offset)
            .finish()
    }
}

struct Cursor<'a> {
    path: &'a Path,
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn file_len(&self) -> u64 {
        self.buf.len() as u64
    }

    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<&'a [u8], GgufError> {
        if n > self.remaining() {
            return Err(GgufError::Truncated {
                path: self.path.to_path_buf(),
                what: what(),
                offset: self.pos as u64,
                needed: n,
                file_len: self.file_len(),
            });
        }
        let s = &self.buf[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn arr<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N], GgufError> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.arr(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.arr(what)?))
    }

    /// Checks that `count` items of at least `min_size` bytes each can fit in the rest of the file.
    fn check_count(
        &self,
        count: u64,
        min_size: u64,
        what: &dyn Fn() -> String,
    ) -> Result<(), GgufError> {
        let fits = count
            .checked_mul(min_size)
            .is_some_and(|b| b <= self.remaining());
        if fits {
            Ok(())
        } else {
            Err(GgufError::AbsurdCount {
                path: self.path.to_path_buf(),
                what: what(),
                count,
                file_len: self.file_len(),
            })
        }
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String, GgufError> {
        let len = self.u64(&|| format!("length of {}", what()))?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::BadUtf8 {
            path: self.path.to_path_buf(),
            what: what(),
        })
    }

    fn name(&mut self, what: &dyn Fn() -> String) -> Result<String, GgufError> {
        let start = self.pos;
        let len = self.u64(&|| format!("length of {}", what()))?;
        if len > MAX_NAME_LEN {
            self.pos = start;
            return Err(GgufError::AbsurdCount {
                path: self.path.to_path_buf(),
                what: format!("length of {}", what()),
                count: len,
                file_len: self.file_len(),
            });
        }
        self.pos = start;
        self.string(what)
    }

    fn value(&mut self, ty: GgufType, key: &str, depth: usize) -> Result<GgufValue, GgufError> {
        let what = || format!("value of metadata key {key:?}");
        Ok(match ty {
            GgufType::U8 => GgufValue::U8(self.arr::<1>(&what)?[0]),
            GgufType::I8 => GgufValue::I8(self.arr::<1>(&what)?[0] as i8),
            GgufType::U16 => GgufValue::U16(u16::from_le_bytes(self.arr(&what)?)),
            GgufType::I16 => GgufValue::I16(i16::from_le_bytes(self.arr(&what)?)),
            GgufType::U32 => GgufValue::U32(u32::from_le_bytes(self.arr(&what)?)),
            GgufType::I32 => GgufValue::I32(i32::from_le_bytes(self.arr(&what)?)),
            GgufType::F32 => GgufValue::F32(f32::from_le_bytes(self.arr(&what)?)),
            GgufType::Bool => GgufValue::Bool(self.arr::<1>(&what)?[0] != 0),
            GgufType::String => GgufValue::String(self.string(&what)?),
            GgufType::U64 => GgufValue::U64(u64::from_le_bytes(self.arr(&what)?)),
            GgufType::I64 => GgufValue::I64(i64::from_le_bytes(self.arr(&what)?)),
            GgufType::F64 => GgufValue::F64(f64::from_le_bytes(self.arr(&what)?)),
            GgufType::Array => GgufValue::Array(self.array(key, depth + 1)?),
        })
    }

    fn array(&mut self, key: &str, depth: usize) -> Result<GgufArray, GgufError> {
        if depth > MAX_ARRAY_DEPTH {
            return Err(GgufError::TooDeep {
                path: self.path.to_path_buf(),
                key: key.to_string(),
            });
        }
        let what = || format!("array of metadata key {key:?}");
        let type_id = self.u32(&what)?;
        let ty = GgufType::from_id(type_id).ok_or_else(|| GgufError::UnknownValueType {
            path: self.path.to_path_buf(),
            key: key.to_string(),
            type_id,
        })?;
        let count = self.u64(&what)?;
        self.check_count(count, ty.min_size(), &|| {
            format!("element count of metadata array {key:?}")
        })?;
        let n = count as usize;
        macro_rules! prim {
            ($variant:ident, $t:ty) => {{
                let bytes = self.take(count * std::mem::size_of::<$t>() as u64, &what)?;
                GgufArray::$variant(
                    bytes
                        .chunks_exact(std::mem::size_of::<$t>())
                        .map(|c| <$t>::from_le_bytes(c.try_into().unwrap()))
                        .collect(),
                )
            }};
        }
        Ok(match ty {
            GgufType::U8 => GgufArray::U8(self.take(count, &what)?.to_vec()),
            GgufType::I8 => {
                GgufArray::I8(self.take(count, &what)?.iter().map(|&b| b as i8).collect())
            }
            GgufType::Bool => {
                GgufArray::Bool(self.take(count, &what)?.iter().map(|&b| b != 0).collect())
            }
            GgufType::U16 => prim!(U16, u16),
            GgufType::I16 => prim!(I16, i16),
            GgufType::U32 => prim!(U32, u32),
            GgufType::I32 => prim!(I32, i32),
            GgufType::F32 => prim!(F32, f32),
            GgufType::U64 => prim!(U64, u64),
            GgufType::I64 => prim!(I64, i64),
            GgufType::F64 => prim!(F64, f64),
            GgufType::String => {
                let mut v = Vec::with_capacity(n);
                for i in 0..n {
                    v.push(self.string(&|| format!("element {i} of metadata array {key:?}"))?);
                }
                GgufArray::String(v)
            }
            GgufType::Array => {
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.array(key, depth + 1)?);
                }
                GgufArray::Array(v)
            }
        })
    }
}

impl GgufFile {
    /// Opens and parses `path`. Tensor data is not read, only mapped.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, GgufError> {
        let path = path.as_ref();
        let io = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        if len < 24 {
            // Too short for even the fixed header: say what is wrong without mapping.
            let mut head = [0u8; 4];
            if len >= 4 {
                use std::io::Read;
                (&file).read_exact(&mut head).map_err(io)?;
                if &head != MAGIC {
                    return Err(GgufError::BadMagic {
                        path: path.to_path_buf(),
                        found: head,
                    });
                }
            }
            return Err(GgufError::Truncated {
                path: path.to_path_buf(),
                what: "GGUF header".into(),
                offset: 0,
                needed: 24,
                file_len: len,
            });
        }
        // SAFETY: the file is opened read-only; like every mmap-based model loader we assume it is
        // not modified while mapped.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        Self::parse(path.to_path_buf(), Arc::new(map))
    }

    fn parse(path: PathBuf, map: Arc<Mmap>) -> Result<Self, GgufError> {
        let buf: &[u8] = &map;
        let mut c = Cursor {
            path: &path,
            buf,
            pos: 0,
        };
        let magic: [u8; 4] = c.arr(&|| "magic".into())?;
        if &magic != MAGIC {
            return Err(GgufError::BadMagic { path, found: magic });
        }
        let version = c.u32(&|| "version".into())?;
        if version != 2 && version != 3 {
            let hint = if version == 1 {
                " (GGUF v1 files predate 64-bit counts; re-convert the model)"
            } else if version.swap_bytes() == 2 || version.swap_bytes() == 3 {
                " (this looks like a big-endian GGUF file; only little-endian is supported)"
            } else {
                ""
            };
            return Err(GgufError::UnsupportedVersion {
                path,
                version,
                hint,
            });
        }
        let tensor_count = c.u64(&|| "tensor count".into())?;
        let kv_count = c.u64(&|| "metadata count".into())?;
        // A metadata pair is at least key length (8) + type (4) + 1 byte; a tensor info at least
        // name length (8) + n_dims (4) + type (4) + offset (8).
        c.check_count(kv_count, 13, &|| "metadata count".into())?;
        c.check_count(tensor_count, 24, &|| "tensor count".into())?;

        let mut metadata = Vec::with_capacity(kv_count as usize);
        let mut index = HashMap::with_capacity(kv_count as usize);
        for i in 0..kv_count {
            let key = c.name(&|| format!("key of metadata pair {i}"))?;
            let type_id = c.u32(&|| format!("type of metadata key {key:?}"))?;
            let ty = GgufType::from_id(type_id).ok_or_else(|| GgufError::UnknownValueType {
                path: path.clone(),
                key: key.clone(),
                type_id,
            })?;
            let value = c.value(ty, &key, 0)?;
            if index.insert(key.clone(), metadata.len()).is_some() {
                return Err(GgufError::Duplicate {
                    path,
                    what: "metadata key",
                    name: key,
                });
            }
            metadata.push((key, value));
        }

        let alignment = match metadata_lookup(&metadata, &index, "general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_int() {
                Some(a) if a > 0 && (a as u64).is_power_of_two() && a <= u32::MAX as i128 => {
                    a as u64
                }
                Some(a) => {
                    return Err(GgufError::BadAlignment {
                        path,
                        alignment: a.clamp(0, u64::MAX as i128) as u64,
                    });
                }
                None => {
                    return Err(GgufError::WrongType {
                        path,
                        key: "general.alignment".into(),
                        expected: "integer",
                        found: v.type_name(),
                    });
                }
            },
        };

        struct RawInfo {
            name: String,
            dims: Vec<u64>,
            type_id: u32,
            offset: u64,
        }
        let mut raw = Vec::with_capacity(tensor_count as usize);
        for i in 0..tensor_count {
            let name = c.name(&|| format!("name of tensor {i}"))?;
            let n_dims = c.u32(&|| format!("dimension count of tensor {name:?}"))?;
            if n_dims > MAX_DIMS {
                return Err(GgufError::TooManyDims { path, name, n_dims });
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(c.u64(&|| format!("dimensions of tensor {name:?}"))?);
            }
            let type_id = c.u32(&|| format!("type of tensor {name:?}"))?;
            let offset = c.u64(&|| format!("offset of tensor {name:?}"))?;
            raw.push(RawInfo {
                name,
                dims,
                type_id,
                offset,
            });
        }
        let header_end = c.pos as u64;
        let data_offset = header_end.div_ceil(alignment) * alignment;
        let file_len = buf.len() as u64;

        let mut tensors = Vec::with_capacity(raw.len());
        let mut tensor_index = HashMap::with_capacity(raw.len());
        for r in raw {
            let ty = QuantType::from_ggml(r.type_id).ok_or_else(|| {
                GgufError::UnsupportedTensorType {
                    path: path.clone(),
                    name: r.name.clone(),
                    type_id: r.type_id,
                    type_name: ggml_type_name(r.type_id),
                }
            })?;
            let bad_shape = |why: String| GgufError::BadShape {
                path: path.clone(),
                name: r.name.clone(),
                dims: r.dims.clone(),
                why,
            };
            if r.dims.contains(&0) {
                return Err(bad_shape("a dimension is zero".into()));
            }
            let cols = r.dims.first().copied().unwrap_or(1);
            let rows = r
                .dims
                .iter()
                .skip(1)
                .try_fold(1u64, |a, &d| a.checked_mul(d))
                .ok_or_else(|| bad_shape("element count overflows".into()))?;
            // No row can be longer than the file; checking first also keeps `row_bytes` from
            // overflowing on absurd column counts.
            if cols / ty.block_len() as u64 > file_len / ty.block_bytes() as u64 + 1 {
                return Err(bad_shape(format!(
                    "{cols} columns of {} cannot fit in a {file_len}-byte file",
                    ty.name()
                )));
            }
            let cols_usize =
                usize::try_from(cols).map_err(|_| bad_shape("too many columns".into()))?;
            let row_bytes = ty.row_bytes(cols_usize).ok_or_else(|| {
                bad_shape(format!(
                    "{} columns is not a multiple of the {} block length {}",
                    cols,
                    ty.name(),
                    ty.block_len()
                ))
            })? as u64;
            let size = row_bytes
                .checked_mul(rows)
                .ok_or_else(|| bad_shape("byte size overflows".into()))?;
            if r.offset % alignment != 0 {
                return Err(GgufError::MisalignedTensor {
                    path,
                    name: r.name,
                    offset: r.offset,
                    alignment,
                });
            }
            let start = data_offset.checked_add(r.offset);
            let end = start.and_then(|s| s.checked_add(size));
            match (start, end) {
                (Some(s), Some(e)) if e <= file_len => {
                    let _ = s;
                }
                _ => {
                    return Err(GgufError::TensorPastEnd {
                        path,
                        name: r.name,
                        start: data_offset.saturating_add(r.offset),
                        end: data_offset.saturating_add(r.offset).saturating_add(size),
                        file_len,
                    });
                }
            }
            if tensor_index.insert(r.name.clone(), tensors.len()).is_some() {
                return Err(GgufError::Duplicate {
                    path,
                    what: "tensor",
                    name: r.name,
                });
            }
            tensors.push(GgufTensorInfo {
                name: r.name,
                dims: r.dims,
                ty,
                offset: r.offset,
                size,
            });
        }

        Ok(Self {
            path,
            map,
            version,
            metadata,
            index,
            tensors,
            tensor_index,
            alignment,
            data_offset,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn version(&self) -> u32 {
        self.version
    }

    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Absolute file offset of the data section.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// Length of the whole file in bytes.
    pub fn file_len(&self) -> u64 {
        self.map.len() as u64
    }

    /// The raw bytes of the whole file (mapped).
    pub fn file_bytes(&self) -> &[u8] {
        &self.map
    }

    /// All metadata pairs in file order.
    pub fn metadata(&self) -> &[(String, GgufValue)] {
        &self.metadata
    }

    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        metadata_lookup(&self.metadata, &self.index, key)
    }

    pub fn contains_key(&self, key: &str) -> bool {
        self.index.contains_key(key)
    }

    fn wrong(&self, key: &str, expected: &'static str, v: &GgufValue) -> GgufError {
        GgufError::WrongType {
            path: self.path.clone(),
            key: key.into(),
            expected,
            found: v.type_name(),
        }
    }

    /// A required key; `MissingKey` when absent.
    pub fn require<T>(&self, key: &str, got: Result<Option<T>, GgufError>) -> Result<T, GgufError> {
        got?.ok_or_else(|| GgufError::MissingKey {
            path: self.path.clone(),
            key: key.into(),
        })
    }

    pub fn get_str(&self, key: &str) -> Result<Option<&str>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(GgufValue::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.wrong(key, "string", v)),
        }
    }

    pub fn get_bool(&self, key: &str) -> Result<Option<bool>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(GgufValue::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.wrong(key, "bool", v)),
        }
    }

    /// Any integer type whose value fits in u64.
    pub fn get_u64(&self, key: &str) -> Result<Option<u64>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => match v.as_int() {
                Some(x) if (0..=u64::MAX as i128).contains(&x) => Ok(Some(x as u64)),
                _ => Err(self.wrong(key, "unsigned integer", v)),
            },
        }
    }

    /// Any integer type whose value fits in u32.
    pub fn get_u32(&self, key: &str) -> Result<Option<u32>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => match v.as_int() {
                Some(x) if (0..=u32::MAX as i128).contains(&x) => Ok(Some(x as u32)),
                _ => Err(self.wrong(key, "unsigned 32-bit integer", v)),
            },
        }
    }

    /// Any integer type whose value fits in i64.
    pub fn get_i64(&self, key: &str) -> Result<Option<i64>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => match v.as_int() {
                Some(x) if (i64::MIN as i128..=i64::MAX as i128).contains(&x) => Ok(Some(x as i64)),
                _ => Err(self.wrong(key, "integer", v)),
            },
        }
    }

    /// f32 or f64 (narrowed).
    pub fn get_f32(&self, key: &str) -> Result<Option<f32>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(GgufValue::F32(x)) => Ok(Some(*x)),
            Some(GgufValue::F64(x)) => Ok(Some(*x as f32)),
            Some(v) => Err(self.wrong(key, "float", v)),
        }
    }

    pub fn get_array(&self, key: &str) -> Result<Option<&GgufArray>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(GgufValue::Array(a)) => Ok(Some(a)),
            Some(v) => Err(self.wrong(key, "array", v)),
        }
    }

    pub fn get_str_array(&self, key: &str) -> Result<Option<&[String]>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(GgufValue::Array(GgufArray::String(v))) => Ok(Some(v)),
            Some(v) => Err(self.wrong(key, "array of string", v)),
        }
    }

    /// An array of any integer element type, as i64.
    pub fn get_int_array(&self, key: &str) -> Result<Option<Vec<i64>>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(v @ GgufValue::Array(a)) => a
                .to_i64_vec()
                .map(Some)
                .ok_or_else(|| self.wrong(key, "array of integer", v)),
            Some(v) => Err(self.wrong(key, "array of integer", v)),
        }
    }

    pub fn tensors(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The data of tensor `name`, shared with the mapping (no copy).
    pub fn tensor_bytes(&self, name: &str) -> Result<WeightBytes, GgufError> {
        let info = self.tensor(name).ok_or_else(|| GgufError::NoSuchTensor {
            path: self.path.clone(),
            name: name.into(),
        })?;
        Ok(self.info_bytes(info))
    }

    /// The data of a tensor info of this file.
    pub fn info_bytes(&self, info: &GgufTensorInfo) -> WeightBytes {
        // Bounds were checked against the file length at parse time.
        let start = (self.data_offset + info.offset) as usize;
        let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = self.map.clone();
        WeightBytes::shared(owner, start..start + info.size as usize)
    }
}

fn metadata_lookup<'a>(
    metadata: &'a [(String, GgufValue)],
    index: &HashMap<String, usize>,
    key: &str,
) -> Option<&'a GgufValue> {
    index.get(key).map(|&i| &metadata[i].1)
}

/// A minimal GGUF writer for tests (here and in other modules).
#[cfg(test)]
pub(crate) mod test_writer {
    use super::{GgufArray, GgufValue};

    pub struct TensorSpec {
        pub name: String,
        pub dims: Vec<u64>,
        pub type_id: u32,
        pub data: Vec<u8>,
    }

    #[derive(Default)]
    pub struct GgufWriter {
        pub version: u32,
        pub alignment: u64,
        pub kv: Vec<(String, GgufValue)>,
        pub tensors: Vec<TensorSpec>,
    }

    fn put_str(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(&(s.len() as u64).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
    }

    fn type_id(v: &GgufValue) -> u32 {
        match v {
            GgufValue::U8(_) => 0,
            GgufValue::I8(_) => 1,
            GgufValue::U16(_) => 2,
            GgufValue::I16(_) => 3,
            GgufValue::U32(_) => 4,
            GgufValue::I32(_) => 5,
            GgufValue::F32(_) => 6,
            GgufValue::Bool(_) => 7,
            GgufValue::String(_) => 8,
            GgufValue::Array(_) => 9,
            GgufValue::U64(_) => 10,
            GgufValue::I64(_) => 11,
            GgufValue::F64(_) => 12,
        }
    }

    fn put_array(out: &mut Vec<u8>, a: &GgufArray) {
        let (id, n) = (a.elem_type(), a.len());
        let id = match id {
            super::GgufType::U8 => 0u32,
            super::GgufType::I8 => 1,
            super::GgufType::U16 => 2,
            super::GgufType::I16 => 3,
            super::GgufType::U32 => 4,
            super::GgufType::I32 => 5,
            super::GgufType::F32 => 6,
            super::GgufType::Bool => 7,
            super::GgufType::String => 8,
            super::GgufType::Array => 9,
            super::GgufType::U64 => 10,
            super::GgufType::I64 => 11,
            super::GgufType::F64 => 12,
        };
        out.extend_from_slice(&id.to_le_bytes());
        out.extend_from_slice(&(n as u64).to_le_bytes());
        match a {
            GgufArray::U8(v) => out.extend_from_slice(v),
            GgufArray::I8(v) => v.iter().for_each(|x| out.push(*x as u8)),
            GgufArray::Bool(v) => v.iter().for_each(|x| out.push(*x as u8)),
            GgufArray::U16(v) => v
                .iter()
                .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
            GgufArray::I16(v) => v
                .iter()
                .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
            GgufArray::U32(v) => v
                .iter()
                .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
            GgufArray::I32(v) => v
                .iter()
                .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
            GgufArray::F32(v) => v
                .iter()
                .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
            GgufArray::U64(v) => v
                .iter()
                .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
            GgufArray::I64(v) => v
                .iter()
                .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
            GgufArray::F64(v) => v
                .iter()
                .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
            GgufArray::String(v) => v.iter().for_each(|s| put_str(out, s)),
            GgufArray::Array(v) => v.iter().for_each(|a| put_array(out, a)),
        }
    }

    pub fn put_value(out: &mut Vec<u8>, v: &GgufValue) {
        match v {
            GgufValue::U8(x) => out.push(*x),
            GgufValue::I8(x) => out.push(*x as u8),
            GgufValue::Bool(x) => out.push(*x as u8),
            GgufValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::String(s) => put_str(out, s),
            GgufValue::Array(a) => put_array(out, a),
        }
    }

    impl GgufWriter {
        pub fn new() -> Self {
            Self {
                version: 3,
                alignment: 32,
                ..Default::default()
            }
        }

        pub fn kv(mut self, key: &str, v: GgufValue) -> Self {
            self.kv.push((key.to_string(), v));
            self
        }

        pub fn tensor(mut self, name: &str, dims: &[u64], type_id: u32, data: Vec<u8>) -> Self {
            self.tensors.push(TensorSpec {
                name: name.into(),
                dims: dims.to_vec(),
                type_id,
                data,
            });
            self
        }

        /// An F32 tensor of the given ggml dims filled with `0.0, 1.0, 2.0, ...`.
        pub fn f32_tensor(self, name: &str, dims: &[u64]) -> Self {
            let n: u64 = dims.iter().product();
            let data = (0..n).flat_map(|i| (i as f32).to_le_bytes()).collect();
            self.tensor(name, dims, 0, data)
        }

        pub fn build(&self) -> Vec<u8> {
            let mut out = Vec::new();
            out.extend_from_slice(b"GGUF");
            out.extend_from_slice(&self.version.to_le_bytes());
            out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
            out.extend_from_slice(&(self.kv.len() as u64).to_le_bytes());
            for (k, v) in &self.kv {
                put_str(&mut out, k);
                out.extend_from_slice(&type_id(v).to_le_bytes());
                put_value(&mut out, v);
            }
            let align = self.alignment;
            let mut offset = 0u64;
            let mut offsets = Vec::new();
            for t in &self.tensors {
                offsets.push(offset);
                offset = (offset + t.data.len() as u64).div_ceil(align) * align;
            }
            for (t, off) in self.tensors.iter().zip(&offsets) {
                put_str(&mut out, &t.name);
                out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
                for d in &t.dims {
                    out.extend_from_slice(&d.to_le_bytes());
                }
                out.extend_from_slice(&t.type_id.to_le_bytes());
                out.extend_from_slice(&off.to_le_bytes());
            }
            let data_start = (out.len() as u64).div_ceil(align) * align;
            out.resize(data_start as usize, 0);
            for (t, off) in self.tensors.iter().zip(&offsets) {
                out.resize((data_start + off) as usize, 0);
                out.extend_from_slice(&t.data);
            }
            out
        }

        pub fn write(&self, dir: &std::path::Path, name: &str) -> std::path::PathBuf {
            let p = dir.join(name);
            std::fs::write(&p, self.build()).unwrap();
            p
        }
    }
}

#[cfg(test)]
mod tests {
    use super::test_writer::GgufWriter;
    use super::*;

    fn sample() -> GgufWriter {
        GgufWriter::new()
            .kv("general.architecture", GgufValue::String("llama".into()))
            .kv("llama.block_count", GgufValue::U32(2))
            .kv("some.u8", GgufValue::U8(7))
            .kv("some.i8", GgufValue::I8(-7))
            .kv("some.u16", GgufValue::U16(700))
            .kv("some.i16", GgufValue::I16(-700))
            .kv("some.i32", GgufValue::I32(-70000))
            .kv("some.f32", GgufValue::F32(1.5))
            .kv("some.bool", GgufValue::Bool(true))
            .kv("some.u64", GgufValue::U64(1 << 40))
            .kv("some.i64", GgufValue::I64(-(1 << 40)))
            .kv("some.f64", GgufValue::F64(2.25))
            .kv(
                "some.strs",
                GgufValue::Array(GgufArray::String(vec!["a".into(), "bc".into(), "".into()])),
            )
            .kv(
                "some.ints",
                GgufValue::Array(GgufArray::I32(vec![1, -2, 3])),
            )
            .kv(
                "some.nested",
                GgufValue::Array(GgufArray::Array(vec![
                    GgufArray::U8(vec![1, 2]),
                    GgufArray::String(vec!["x".into()]),
                ])),
            )
            .f32_tensor("a.weight", &[4, 3])
            .f32_tensor("b.weight", &[5])
    }

    fn write(bytes: &[u8]) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.gguf");
        std::fs::write(&p, bytes).unwrap();
        (dir, p)
    }

    #[test]
    fn parses_metadata_and_tensors() {
        let (_d, p) = write(&sample().build());
        let f = GgufFile::open(&p).unwrap();
        assert_eq!(f.version(), 3);
        assert_eq!(f.alignment(), 32);
        assert_eq!(f.data_offset() % 32, 0);
        assert_eq!(f.get_str("general.architecture").unwrap(), Some("llama"));
        assert_eq!(f.get_u32("llama.block_count").unwrap(), Some(2));
        assert_eq!(f.get_u32("some.u8").unwrap(), Some(7));
        assert_eq!(f.get_i64("some.i8").unwrap(), Some(-7));
        assert_eq!(f.get_u32("some.u16").unwrap(), Some(700));
        assert_eq!(f.get_i64("some.i16").unwrap(), Some(-700));
        assert_eq!(f.get_i64("some.i32").unwrap(), Some(-70000));
        assert_eq!(f.get_f32("some.f32").unwrap(), Some(1.5));
        assert_eq!(f.get_bool("some.bool").unwrap(), Some(true));
        assert_eq!(f.get_u64("some.u64").unwrap(), Some(1 << 40));
        assert_eq!(f.get_i64("some.i64").unwrap(), Some(-(1 << 40)));
        assert_eq!(f.get_f32("some.f64").unwrap(), Some(2.25));
        assert_eq!(
            f.get_str_array("some.strs").unwrap().unwrap(),
            &["a", "bc", ""]
        );
        assert_eq!(
            f.get_int_array("some.ints").unwrap().unwrap(),
            vec![1, -2, 3]
        );
        match f.get("some.nested").unwrap() {
            GgufValue::Array(GgufArray::Array(v)) => {
                assert_eq!(v[0], GgufArray::U8(vec![1, 2]));
                assert_eq!(v[1], GgufArray::String(vec!["x".into()]));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(f.get_str("missing").unwrap(), None);
        // Wrong types are errors naming the key.
        let e = f.get_u32("some.i32").unwrap_err().to_string();
        assert!(e.contains("some.i32") && e.contains("i32"), "{e}");
        let e = f.get_str("some.f32").unwrap_err().to_string();
        assert!(e.contains("expected string"), "{e}");
        let e = f
            .require("nope", f.get_u32("nope"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("\"nope\" is missing") && e.contains("m.gguf"),
            "{e}"
        );

        assert_eq!(f.tensors().len(), 2);
        let a = f.tensor("a.weight").unwrap();
        assert_eq!((a.rows(), a.cols()), (3, 4));
        assert_eq!(a.ty, QuantType::F32);
        let bytes = f.tensor_bytes("a.weight").unwrap();
        assert_eq!(bytes.len(), 48);
        assert_eq!(f32::from_le_bytes(bytes[44..48].try_into().unwrap()), 11.0);
        let b = f.tensor("b.weight").unwrap();
        assert_eq!((b.rows(), b.cols()), (1, 5));
        assert_eq!(b.offset % 32, 0);
        let bb = f.tensor_bytes("b.weight").unwrap();
        assert_eq!(f32::from_le_bytes(bb[16..20].try_into().unwrap()), 4.0);
        assert!(matches!(
            f.tensor_bytes("c").unwrap_err(),
            GgufError::NoSuchTensor { .. }
        ));
    }

    #[test]
    fn version_2_and_custom_alignment() {
        let mut w = sample().kv("general.alignment", GgufValue::U32(64));
        w.version = 2;
        w.alignment = 64;
        let (_d, p) = write(&w.build());
        let f = GgufFile::open(&p).unwrap();
        assert_eq!(f.version(), 2);
        assert_eq!(f.alignment(), 64);
        assert_eq!(f.data_offset() % 64, 0);
        assert_eq!(
            f32::from_le_bytes(
                f.tensor_bytes("b.weight").unwrap()[4..8]
                    .try_into()
                    .unwrap()
            ),
            1.0
        );
    }

    #[test]
    fn bad_alignment() {
        let w = GgufWriter::new().kv("general.alignment", GgufValue::U32(48));
        let (_d, p) = write(&w.build());
        assert!(matches!(
            GgufFile::open(&p).unwrap_err(),
            GgufError::BadAlignment { alignment: 48, .. }
        ));
    }

    #[test]
    fn quantized_tensor_sizes() {
        // Q8_0: blocks of 32 values in 34 bytes. 64 cols x 2 rows = 4 blocks = 136 bytes.
        let w = GgufWriter::new().tensor("q", &[64, 2], 8, vec![0u8; 136]);
        let (_d, p) = write(&w.build());
        let f = GgufFile::open(&p).unwrap();
        let t = f.tensor("q").unwrap();
        assert_eq!(t.ty, QuantType::Q8_0);
        assert_eq!(t.size, 136);
        // Columns not a multiple of the block.
        let w = GgufWriter::new().tensor("q", &[33, 2], 8, vec![0u8; 136]);
        let (_d, p) = write(&w.build());
        let e = GgufFile::open(&p).unwrap_err();
        assert!(matches!(e, GgufError::BadShape { .. }), "{e}");
        assert!(e.to_string().contains("block length"), "{e}");
    }

    #[test]
    fn every_truncation_is_an_error() {
        let bytes = sample().build();
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.gguf");
        // Every prefix must fail cleanly (never panic). The full file parses.
        for len in (0..bytes.len()).step_by(3).chain([bytes.len() - 1]) {
            std::fs::write(&p, &bytes[..len]).unwrap();
            let e = GgufFile::open(&p).unwrap_err();
            let msg = e.to_string();
            assert!(msg.contains("t.gguf"), "{msg}");
            assert!(
                matches!(
                    e,
                    GgufError::Truncated { .. }
                        | GgufError::AbsurdCount { .. }
                        | GgufError::TensorPastEnd { .. }
                ),
                "prefix {len}: {msg}"
            );
        }
    }

    #[test]
    fn wrong_magic_and_version() {
        let mut bytes = sample().build();
        bytes[0] = b'X';
        let (_d, p) = write(&bytes);
        let e = GgufFile::open(&p).unwrap_err();
        assert!(matches!(e, GgufError::BadMagic { .. }), "{e}");
        assert!(e.to_string().contains("not a GGUF file"));

        let (_d, p) = write(b"NOPE");
        assert!(matches!(
            GgufFile::open(&p).unwrap_err(),
            GgufError::BadMagic { .. }
        ));

        let mut bytes = sample().build();
        bytes[4..8].copy_from_slice(&1u32.to_le_bytes());
        let (_d, p) = write(&bytes);
        let e = GgufFile::open(&p).unwrap_err();
        assert!(
            matches!(e, GgufError::UnsupportedVersion { version: 1, .. }),
            "{e}"
        );

        let mut bytes = sample().build();
        bytes[4..8].copy_from_slice(&3u32.to_be_bytes());
        let (_d, p) = write(&bytes);
        let e = GgufFile::open(&p).unwrap_err();
        assert!(e.to_string().contains("big-endian"), "{e}");
    }

    #[test]
    fn absurd_counts_do_not_allocate() {
        let mut bytes = sample().build();
        bytes[8..16].copy_from_slice(&u64::MAX.to_le_bytes()); // tensor count
        let (_d, p) = write(&bytes);
        assert!(matches!(
            GgufFile::open(&p).unwrap_err(),
            GgufError::AbsurdCount { .. }
        ));

        let mut bytes = sample().build();
        bytes[16..24].copy_from_slice(&(1u64 << 60).to_le_bytes()); // kv count
        let (_d, p) = write(&bytes);
        assert!(matches!(
            GgufFile::open(&p).unwrap_err(),
            GgufError::AbsurdCount { .. }
        ));

        // A string array claiming 2^62 elements.
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&0u64.to_le_bytes());
        out.extend_from_slice(&1u64.to_le_bytes());
        out.extend_from_slice(&3u64.to_le_bytes());
        out.extend_from_slice(b"arr");
        out.extend_from_slice(&9u32.to_le_bytes());
        out.extend_from_slice(&8u32.to_le_bytes());
        out.extend_from_slice(&(1u64 << 62).to_le_bytes());
        out.extend_from_slice(&[0u8; 64]);
        let (_d, p) = write(&out);
        let e = GgufFile::open(&p).unwrap_err();
        assert!(matches!(e, GgufError::AbsurdCount { .. }), "{e}");
        assert!(e.to_string().contains("\"arr\""), "{e}");

        // A key whose length is huge.
        let mut out = out[..24].to_vec();
        out.extend_from_slice(&u64::MAX.to_le_bytes());
        out.extend_from_slice(&[0u8; 64]);
        let (_d, p) = write(&out);
        let e = GgufFile::open(&p).unwrap_err();
        assert!(matches!(e, GgufError::AbsurdCount { .. }), "{e}");
    }

    #[test]
    fn unknown_value_type_and_deep_nesting() {
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&0u64.to_le_bytes());
        out.extend_from_slice(&1u64.to_le_bytes());
        out.extend_from_slice(&1u64.to_le_bytes());
        out.extend_from_slice(b"k");
        out.extend_from_slice(&99u32.to_le_bytes());
        out.extend_from_slice(&[0u8; 16]);
        let (_d, p) = write(&out);
        let e = GgufFile::open(&p).unwrap_err();
        assert!(
            matches!(e, GgufError::UnknownValueType { type_id: 99, .. }),
            "{e}"
        );

        let mut deep = GgufArray::U8(vec![1]);
        for _ in 0..12 {
            deep = GgufArray::Array(vec![deep]);
        }
        let w = GgufWriter::new().kv("deep", GgufValue::Array(deep));
        let (_d, p) = write(&w.build());
        assert!(matches!(
            GgufFile::open(&p).unwrap_err(),
            GgufError::TooDeep { .. }
        ));
    }

    #[test]
    fn unsupported_tensor_type() {
        let w = GgufWriter::new().tensor("x", &[256], 13, vec![0u8; 176]);
        let (_d, p) = write(&w.build());
        let e = GgufFile::open(&p).unwrap_err();
        assert!(
            matches!(e, GgufError::UnsupportedTensorType { type_id: 13, .. }),
            "{e}"
        );
        assert!(e.to_string().contains("Q5_K"), "{e}");
        let w = GgufWriter::new().tensor("x", &[4], 1234, vec![0u8; 16]);
        let (_d, p) = write(&w.build());
        let e = GgufFile::open(&p).unwrap_err().to_string();
        assert!(e.contains("1234") && e.contains("unknown"), "{e}");
    }

    #[test]
    fn tensor_past_end_and_misaligned() {
        let mut bytes = GgufWriter::new().f32_tensor("x", &[8]).build();
        bytes.truncate(bytes.len() - 4);
        let (_d, p) = write(&bytes);
        let e = GgufFile::open(&p).unwrap_err();
        assert!(matches!(e, GgufError::TensorPastEnd { .. }), "{e}");
        assert!(e.to_string().contains("\"x\""));

        // Huge dims overflow or run past the end, never panic.
        let w = GgufWriter::new().tensor("x", &[u64::MAX / 2, 4], 0, vec![]);
        let (_d, p) = write(&w.build());
        let e = GgufFile::open(&p).unwrap_err();
        assert!(
            matches!(
                e,
                GgufError::BadShape { .. } | GgufError::TensorPastEnd { .. }
            ),
            "{e}"
        );
        let w = GgufWriter::new().tensor("x", &[0, 4], 0, vec![]);
        let (_d, p) = write(&w.build());
        assert!(matches!(
            GgufFile::open(&p).unwrap_err(),
            GgufError::BadShape { .. }
        ));
        let w = GgufWriter::new().tensor("x", &[1, 1, 1, 1, 1], 0, vec![0; 4]);
        let (_d, p) = write(&w.build());
        assert!(matches!(
            GgufFile::open(&p).unwrap_err(),
            GgufError::TooManyDims { .. }
        ));

        // Offset not a multiple of the alignment: patch the offset field (last 8 bytes of the
        // tensor info, just before the padding).
        let w = GgufWriter::new().f32_tensor("x", &[8]);
        let mut bytes = w.build();
        let info_end = 24 + (8 + 1) + 4 + 8 + 4 + 8;
        bytes[info_end - 8..info_end].copy_from_slice(&4u64.to_le_bytes());
        let (_d, p) = write(&bytes);
        let e = GgufFile::open(&p).unwrap_err();
        assert!(
            matches!(e, GgufError::MisalignedTensor { offset: 4, .. }),
            "{e}"
        );
    }

    #[test]
    fn duplicates_and_missing_file() {
        let w = GgufWriter::new()
            .kv("a", GgufValue::U8(1))
            .kv("a", GgufValue::U8(2));
        let (_d, p) = write(&w.build());
        assert!(matches!(
            GgufFile::open(&p).unwrap_err(),
            GgufError::Duplicate { .. }
        ));
        let w = GgufWriter::new()
            .f32_tensor("x", &[8])
            .f32_tensor("x", &[8]);
        let (_d, p) = write(&w.build());
        assert!(matches!(
            GgufFile::open(&p).unwrap_err(),
            GgufError::Duplicate { .. }
        ));
        let e = GgufFile::open("/nonexistent/dir/x.gguf").unwrap_err();
        assert!(matches!(e, GgufError::Io { .. }));
        assert!(e.to_string().contains("/nonexistent/dir/x.gguf"));
    }

    #[test]
    fn bad_utf8_key() {
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&0u64.to_le_bytes());
        out.extend_from_slice(&1u64.to_le_bytes());
        out.extend_from_slice(&2u64.to_le_bytes());
        out.extend_from_slice(&[0xff, 0xfe]);
        out.extend_from_slice(&0u32.to_le_bytes());
        out.push(1);
        out.extend_from_slice(&[0u8; 16]);
        let (_d, p) = write(&out);
        assert!(matches!(
            GgufFile::open(&p).unwrap_err(),
            GgufError::BadUtf8 { .. }
        ));
    }

    #[test]
    fn random_corruption_never_panics() {
        let good = sample().build();
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("fuzz.gguf");
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for _ in 0..1500 {
            let mut bytes = good.clone();
            for _ in 0..1 + next() % 4 {
                let i = (next() % bytes.len() as u64) as usize;
                bytes[i] = match next() % 3 {
                    0 => next() as u8,
                    1 => 0xff,
                    _ => 0,
                };
            }
            std::fs::write(&p, &bytes).unwrap();
            // Either parses or fails with an error; a panic fails the test.
            let _ = GgufFile::open(&p);
        }
    }

    #[test]
    fn real_model_header() {
        let p = crate::model_path::checkout_default_model();
        let f = GgufFile::open(&p).unwrap();
        assert_eq!(f.version(), 3);
        assert_eq!(f.tensors().len(), 272);
        assert_eq!(f.get_str("general.architecture").unwrap(), Some("llama"));
        assert_eq!(
            f.get_str_array("tokenizer.ggml.tokens")
                .unwrap()
                .unwrap()
                .len(),
            49152
        );
        let t = f.tensor("blk.0.attn_k.weight").unwrap();
        assert_eq!((t.rows(), t.cols(), t.ty), (192, 576, QuantType::Q4_1));
        assert_eq!(t.size, 69120);
    }
}
