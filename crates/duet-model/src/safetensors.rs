//! A safetensors reader (the header parsed here, the data memory-mapped) and the HF directory
//! layout: `model.safetensors`, or shards listed in `model.safetensors.index.json`.
//!
//! File layout: an 8-byte little-endian header length N, N bytes of JSON
//! (`{"name": {"dtype": "F32", "shape": [r, c], "data_offsets": [begin, end]}, "__metadata__": {...}}`),
//! then the data; offsets are relative to the end of the header.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use serde_json::Value;

use crate::quant_type::QuantType;
use crate::storage::WeightBytes;

/// Headers larger than this are refused (real ones are well under 1 MiB).
const MAX_HEADER_LEN: u64 = 100 << 20;

#[derive(Debug, thiserror::Error)]
pub enum SafetensorsError {
    #[error("{path}: cannot read: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a safetensors file: {why}")]
    BadHeader { path: PathBuf, why: String },
    #[error(
        "{path}: tensor {name:?}: unsupported dtype {dtype} (supported: F32, F16, BF16, F8_E4M3)"
    )]
    UnsupportedDtype {
        path: PathBuf,
        name: String,
        dtype: String,
    },
    #[error("{path}: tensor {name:?}: {why}")]
    BadTensor {
        path: PathBuf,
        name: String,
        why: String,
    },
    #[error("{path}: bad shard index: {why}")]
    BadIndex { path: PathBuf, why: String },
    #[error("{dir}: no model.safetensors and no model.safetensors.index.json")]
    NoWeights { dir: PathBuf },
    #[error("tensor {name:?} appears in both {first} and {second}")]
    Duplicate {
        name: String,
        first: PathBuf,
        second: PathBuf,
    },
}

/// The element type of a safetensors tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SafeDtype {
    /// F32, F16 or BF16.
    Float(QuantType),
    /// FP8 E4M3 (`float8_e4m3fn`), with its scales in tensors beside it ([`crate::fp8`]).
    F8E4M3,
}

impl SafeDtype {
    /// Bytes of one element.
    fn bytes(self) -> u64 {
        match self {
            Self::Float(ty) => ty.block_bytes() as u64,
            Self::F8E4M3 => 1,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Float(ty) => ty.name(),
            Self::F8E4M3 => "F8_E4M3",
        }
    }
}

/// One tensor of a safetensors file.
#[derive(Debug, Clone)]
pub struct SafeTensorInfo {
    pub name: String,
    pub dtype: SafeDtype,
    /// HF shape, outermost first.
    pub shape: Vec<usize>,
    /// Absolute byte range in the file.
    pub start: usize,
    pub end: usize,
}

impl SafeTensorInfo {
    /// The innermost dimension (1 for a scalar).
    pub fn cols(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }

    /// The product of the outer dimensions (1 for a 1-D tensor).
    pub fn rows(&self) -> usize {
        self.shape.iter().rev().skip(1).product()
    }
}

/// One memory-mapped safetensors file.
pub struct SafetensorsFile {
    path: PathBuf,
    map: Arc<Mmap>,
    tensors: BTreeMap<String, SafeTensorInfo>,
}

impl std::fmt::Debug for SafetensorsFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SafetensorsFile")
            .field("path", &self.path)
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl SafetensorsFile {
    pub fn open(path: impl AsRef<Path>) -> Result<Self, SafetensorsError> {
        let path = path.as_ref().to_path_buf();
        let io = |source| SafetensorsError::Io {
            path: path.clone(),
            source,
        };
        let file = File::open(&path).map_err(io)?;
        let file_len = file.metadata().map_err(io)?.len();
        let bad = |why: String| SafetensorsError::BadHeader {
            path: path.clone(),
            why,
        };
        if file_len < 8 {
            return Err(bad(format!(
                "file is {file_len} bytes, too short for the 8-byte header length"
            )));
        }
        // SAFETY: read-only mapping of a model file assumed not to change while mapped.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        let n = u64::from_le_bytes(map[..8].try_into().unwrap());
        if n > MAX_HEADER_LEN || n > file_len - 8 {
            return Err(bad(format!(
                "header length {n} does not fit in a {file_len}-byte file"
            )));
        }
        let header_end = 8 + n as usize;
        let header: Value = serde_json::from_slice(&map[8..header_end])
            .map_err(|e| bad(format!("header is not valid JSON: {e}")))?;
        let obj = header
            .as_object()
            .ok_or_else(|| bad("header is not a JSON object".into()))?;
        let data_len = file_len - 8 - n;
        let mut tensors = BTreeMap::new();
        for (name, v) in obj {
            if name == "__metadata__" {
                continue;
            }
            let bad_t = |why: String| SafetensorsError::BadTensor {
                path: path.clone(),
                name: name.clone(),
                why,
            };
            let dtype = v
                .get("dtype")
                .and_then(Value::as_str)
                .ok_or_else(|| bad_t("no \"dtype\"".into()))?;
            let ty = match dtype {
                "F32" => SafeDtype::Float(QuantType::F32),
                "F16" => SafeDtype::Float(QuantType::F16),
                "BF16" => SafeDtype::Float(QuantType::BF16),
                "F8_E4M3" => SafeDtype::F8E4M3,
                other => {
                    return Err(SafetensorsError::UnsupportedDtype {
                        path: path.clone(),
                        name: name.clone(),
                        dtype: other.into(),
                    });
                }
            };
            let shape: Vec<u64> = v
                .get("shape")
                .and_then(Value::as_array)
                .and_then(|a| a.iter().map(Value::as_u64).collect::<Option<_>>())
                .ok_or_else(|| bad_t("\"shape\" is not a list of non-negative integers".into()))?;
            let offs: Vec<u64> = v
                .get("data_offsets")
                .and_then(Value::as_array)
                .and_then(|a| a.iter().map(Value::as_u64).collect::<Option<_>>())
                .filter(|o: &Vec<u64>| o.len() == 2)
                .ok_or_else(|| bad_t("\"data_offsets\" is not [begin, end]".into()))?;
            let (b, e) = (offs[0], offs[1]);
            if b > e || e > data_len {
                return Err(bad_t(format!(
                    "data [{b}, {e}) lies outside the {data_len} data bytes of the file (file is {file_len} bytes)"
                )));
            }
            let bytes = shape
                .iter()
                .try_fold(ty.bytes(), |a, &d| a.checked_mul(d))
                .ok_or_else(|| bad_t(format!("shape {shape:?} overflows")))?;
            if bytes != e - b {
                return Err(bad_t(format!(
                    "shape {shape:?} of {dtype} needs {bytes} bytes, data_offsets span {}",
                    e - b
                )));
            }
            let shape: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
            let start = header_end + b as usize;
            tensors.insert(
                name.clone(),
                SafeTensorInfo {
                    name: name.clone(),
                    dtype: ty,
                    shape,
                    start,
                    end: header_end + e as usize,
                },
            );
        }
        Ok(Self {
            path,
            map: Arc::new(map),
            tensors,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn tensors(&self) -> impl Iterator<Item = &SafeTensorInfo> {
        self.tensors.values()
    }

    pub fn tensor(&self, name: &str) -> Option<&SafeTensorInfo> {
        self.tensors.get(name)
    }

    /// The data of a tensor of this file, shared with the mapping.
    pub fn info_bytes(&self, info: &SafeTensorInfo) -> WeightBytes {
        let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = self.map.clone();
        WeightBytes::shared(owner, info.start..info.end)
    }

    /// The raw bytes of the whole file (mapped).
    pub fn file_bytes(&self) -> &[u8] {
        &self.map
    }
}

/// Opens the weight files of a HF model directory: `model.safetensors`, or every shard named in
/// `model.safetensors.index.json` (checking each indexed tensor is in the shard it names).
pub fn open_safetensors_dir(dir: &Path) -> Result<Vec<SafetensorsFile>, SafetensorsError> {
    let single = dir.join("model.safetensors");
    let index_path = dir.join("model.safetensors.index.json");
    if index_path.exists() {
        let bad = |why: String| SafetensorsError::BadIndex {
            path: index_path.clone(),
            why,
        };
        let text = std::fs::read_to_string(&index_path).map_err(|source| SafetensorsError::Io {
            path: index_path.clone(),
            source,
        })?;
        let v: Value =
            serde_json::from_str(&text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
        let map = v
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| bad("no \"weight_map\" object".into()))?;
        let mut shards = BTreeSet::new();
        for (name, file) in map {
            let file = file
                .as_str()
                .ok_or_else(|| bad(format!("entry for {name:?} is not a file name")))?;
            if file.contains('/') || file.contains('\\') || file == ".." {
                return Err(bad(format!("shard name {file:?} is not a plain file name")));
            }
            shards.insert(file.to_string());
        }
        let files = shards
            .iter()
            .map(|s| SafetensorsFile::open(dir.join(s)))
            .collect::<Result<Vec<_>, _>>()?;
        for (name, file) in map {
            let file = file.as_str().unwrap_or_default();
            let shard = files
                .iter()
                .find(|f| f.path().file_name().is_some_and(|n| n == file));
            if shard.is_none_or(|s| s.tensor(name).is_none()) {
                return Err(bad(format!("tensor {name:?} is not in shard {file}")));
            }
        }
        check_no_duplicates(&files)?;
        Ok(files)
    } else if single.exists() {
        Ok(vec![SafetensorsFile::open(&single)?])
    } else {
        Err(SafetensorsError::NoWeights {
            dir: dir.to_path_buf(),
        })
    }
}

fn check_no_duplicates(files: &[SafetensorsFile]) -> Result<(), SafetensorsError> {
    let mut seen: BTreeMap<&str, &Path> = BTreeMap::new();
    for f in files {
        for t in f.tensors() {
            if let Some(first) = seen.insert(&t.name, f.path()) {
                return Err(SafetensorsError::Duplicate {
                    name: t.name.clone(),
                    first: first.to_path_buf(),
                    second: f.path().to_path_buf(),
                });
            }
        }
    }
    Ok(())
}

/// A small safetensors writer for tests.
#[cfg(test)]
pub(crate) mod test_writer {
    /// Writes a safetensors file of `(name, dtype, shape, data)` tensors.
    pub fn build(tensors: &[(&str, &str, Vec<usize>, Vec<u8>)]) -> Vec<u8> {
        let mut header = serde_json::Map::new();
        header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
        let mut off = 0usize;
        for (name, dtype, shape, data) in tensors {
            header.insert(
                name.to_string(),
                serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [off, off + data.len()]}),
            );
            off += data.len();
        }
        let mut h = serde_json::to_vec(&header).unwrap();
        while !h.len().is_multiple_of(8) {
            h.push(b' ');
        }
        let mut out = (h.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(&h);
        for (_, _, _, data) in tensors {
            out.extend_from_slice(data);
        }
        out
    }

    /// An F32 tensor of `shape` filled with 0, 1, 2, ...
    pub fn f32_data(shape: &[usize]) -> Vec<u8> {
        let n: usize = shape.iter().product();
        (0..n).flat_map(|i| (i as f32).to_le_bytes()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::test_writer::{build, f32_data};
    use super::*;

    #[test]
    fn parses_single_file() {
        let dir = tempfile::tempdir().unwrap();
        let bytes = build(&[
            ("a", "F32", vec![2, 3], f32_data(&[2, 3])),
            ("b", "BF16", vec![4], vec![0u8; 8]),
            ("c", "F16", vec![2, 2], vec![1u8; 8]),
            ("d", "F8_E4M3", vec![2, 3], vec![0x38u8; 6]),
        ]);
        std::fs::write(dir.path().join("model.safetensors"), &bytes).unwrap();
        let files = open_safetensors_dir(dir.path()).unwrap();
        assert_eq!(files.len(), 1);
        let f = &files[0];
        let a = f.tensor("a").unwrap();
        assert_eq!(
            (a.rows(), a.cols(), a.dtype),
            (2, 3, SafeDtype::Float(QuantType::F32))
        );
        let d = f.info_bytes(a);
        assert_eq!(f32::from_le_bytes(d[20..24].try_into().unwrap()), 5.0);
        let b = f.tensor("b").unwrap();
        assert_eq!(
            (b.rows(), b.cols(), b.dtype),
            (1, 4, SafeDtype::Float(QuantType::BF16))
        );
        assert_eq!(
            f.tensor("c").unwrap().dtype,
            SafeDtype::Float(QuantType::F16)
        );
        let d = f.tensor("d").unwrap();
        assert_eq!((d.rows(), d.cols(), d.dtype), (2, 3, SafeDtype::F8E4M3));
    }

    #[test]
    fn sharded() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("model-00001-of-00002.safetensors"),
            build(&[("a", "F32", vec![2], f32_data(&[2]))]),
        )
        .unwrap();
        std::fs::write(
            dir.path().join("model-00002-of-00002.safetensors"),
            build(&[("b", "F32", vec![3], f32_data(&[3]))]),
        )
        .unwrap();
        let index = serde_json::json!({"metadata": {}, "weight_map": {
            "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}});
        std::fs::write(
            dir.path().join("model.safetensors.index.json"),
            index.to_string(),
        )
        .unwrap();
        let files = open_safetensors_dir(dir.path()).unwrap();
        assert_eq!(files.len(), 2);
        assert!(files[1].tensor("b").is_some());

        let index = serde_json::json!({"weight_map": {"a": "model-00002-of-00002.safetensors"}});
        std::fs::write(
            dir.path().join("model.safetensors.index.json"),
            index.to_string(),
        )
        .unwrap();
        let e = open_safetensors_dir(dir.path()).unwrap_err().to_string();
        assert!(e.contains("\"a\" is not in shard"), "{e}");

        let index = serde_json::json!({"weight_map": {"a": "../evil.safetensors"}});
        std::fs::write(
            dir.path().join("model.safetensors.index.json"),
            index.to_string(),
        )
        .unwrap();
        assert!(matches!(
            open_safetensors_dir(dir.path()).unwrap_err(),
            SafetensorsError::BadIndex { .. }
        ));
    }

    #[test]
    fn errors() {
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(
            open_safetensors_dir(dir.path()).unwrap_err(),
            SafetensorsError::NoWeights { .. }
        ));
        let p = dir.path().join("x.safetensors");
        let open = |bytes: &[u8]| {
            std::fs::write(&p, bytes).unwrap();
            SafetensorsFile::open(&p).unwrap_err()
        };
        let e = open(&build(&[("a", "I64", vec![1], vec![0u8; 8])]));
        assert!(
            matches!(e, SafetensorsError::UnsupportedDtype { .. }),
            "{e}"
        );
        assert!(e.to_string().contains("I64") && e.to_string().contains("x.safetensors"));
        let e = open(&[1, 2, 3]);
        assert!(matches!(e, SafetensorsError::BadHeader { .. }), "{e}");
        let mut b = build(&[("a", "F32", vec![2], f32_data(&[2]))]);
        b[..8].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(open(&b), SafetensorsError::BadHeader { .. }));
        // Data truncated.
        let mut b = build(&[("a", "F32", vec![4], f32_data(&[4]))]);
        b.truncate(b.len() - 1);
        let e = open(&b);
        assert!(e.to_string().contains("outside"), "{e}");
        // Shape disagrees with offsets.
        let e = open(&build(&[("a", "F32", vec![3], f32_data(&[2]))]));
        assert!(e.to_string().contains("needs 12 bytes"), "{e}");
        // Header not JSON.
        let mut b = 4u64.to_le_bytes().to_vec();
        b.extend_from_slice(b"{{{{");
        assert!(open(&b).to_string().contains("not valid JSON"));
    }
}
