//! Checkpoint tensors: safetensors files (single or sharded with an index), memory-mapped,
//! validated up front, and turned into MLX arrays on request.
//!
//! Every failure names the file and the tensor: a truncated shard, a tensor whose byte range
//! runs past the end of its file, an index that points at a missing shard, or a shape that
//! disagrees with the config.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use indicatif::ProgressBar;
use memmap2::Mmap;
use mlx_rs::{Array, Dtype};
use safetensors::tensor::{Dtype as StDtype, SafeTensors};

struct Shard {
    path: PathBuf,
    map: Mmap,
    /// Offset of the data section (8-byte length + JSON header).
    data_start: usize,
}

/// Where one tensor's bytes live.
#[derive(Debug, Clone)]
pub struct TensorEntry {
    shard: usize,
    pub dtype: StDtype,
    pub shape: Vec<usize>,
    begin: usize,
    end: usize,
}

/// Anything the model loader can read named tensors from: a checkpoint on disk
/// ([`WeightStore`]) or generated weights (`--random-weights`).
pub trait TensorSource {
    /// Whether a tensor of this name exists.
    fn contains(&self, name: &str) -> bool;
    /// The tensor as an MLX array in its stored dtype, after checking its shape.
    fn array(&self, name: &str, expected_shape: &[usize]) -> Result<Array>;
    /// The stored dtype of a tensor, if it exists.
    fn dtype_of(&self, name: &str) -> Option<Dtype>;
}

/// All tensors of a checkpoint folder, by full name.
pub struct WeightStore {
    shards: Vec<Shard>,
    tensors: BTreeMap<String, TensorEntry>,
    progress: Option<ProgressBar>,
}

fn map_file(path: &Path) -> Result<Mmap> {
    let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    // SAFETY: the map is read-only; a checkpoint rewritten while we run is a user error that
    // at worst yields wrong numbers, which the validation below cannot prevent either.
    unsafe { Mmap::map(&file) }.with_context(|| format!("cannot memory-map {}", path.display()))
}

impl WeightStore {
    /// Opens `model.safetensors`, or every shard listed in `model.safetensors.index.json`, or
    /// (failing both) every `*.safetensors` file in `dir`.
    pub fn open(dir: &Path) -> Result<Self> {
        let index_path = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if index_path.is_file() {
            let text = std::fs::read_to_string(&index_path)
                .with_context(|| format!("cannot read {}", index_path.display()))?;
            let index: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("{} is not valid JSON", index_path.display()))?;
            let map = index
                .get("weight_map")
                .and_then(|m| m.as_object())
                .with_context(|| format!("{} has no `weight_map` object", index_path.display()))?;
            let mut names: Vec<String> = map
                .values()
                .map(|v| v.as_str().map(str::to_owned))
                .collect::<Option<_>>()
                .with_context(|| {
                    format!(
                        "{}: `weight_map` values must be file names",
                        index_path.display()
                    )
                })?;
            names.sort();
            names.dedup();
            names.into_iter().map(|n| dir.join(n)).collect()
        } else if dir.join("model.safetensors").is_file() {
            vec![dir.join("model.safetensors")]
        } else {
            let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
                .with_context(|| format!("cannot list {}", dir.display()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            found.sort();
            found
        };
        if files.is_empty() {
            bail!(
                "no weights in {}: expected model.safetensors or model.safetensors.index.json",
                dir.display()
            );
        }

        let mut store = WeightStore {
            shards: Vec::new(),
            tensors: BTreeMap::new(),
            progress: None,
        };
        for path in files {
            store.add_shard(path)?;
        }
        Ok(store)
    }

    fn add_shard(&mut self, path: PathBuf) -> Result<()> {
        if !path.is_file() {
            bail!(
                "weight file {} is missing (listed in the index)",
                path.display()
            );
        }
        let map = map_file(&path)?;
        let (header_len, meta) = SafeTensors::read_metadata(&map).map_err(|e| {
            anyhow::anyhow!(
                "{} is not a valid safetensors file ({e}); is it truncated or corrupt?",
                path.display()
            )
        })?;
        let data_start = 8 + header_len;
        let shard = self.shards.len();
        for (name, info) in meta.tensors() {
            let (b, e) = info.data_offsets;
            let numel: usize = info.shape.iter().product();
            let want = numel * info.dtype.bitsize() / 8;
            if e < b || e - b != want {
                bail!(
                    "{}: tensor {name} has {} bytes but its shape {:?} and dtype {:?} need {want}",
                    path.display(),
                    e.saturating_sub(b),
                    info.shape,
                    info.dtype
                );
            }
            if data_start + e > map.len() {
                bail!(
                    "{}: tensor {name} ends at byte {} but the file has {} bytes (truncated?)",
                    path.display(),
                    data_start + e,
                    map.len()
                );
            }
            if let Some(prev) = self.tensors.get(&name) {
                bail!(
                    "tensor {name} appears in both {} and {}",
                    self.shards[prev.shard].path.display(),
                    path.display()
                );
            }
            self.tensors.insert(
                name,
                TensorEntry {
                    shard,
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                    begin: b,
                    end: e,
                },
            );
        }
        self.shards.push(Shard {
            path,
            map,
            data_start,
        });
        Ok(())
    }

    /// Total bytes of tensor data, for the load progress bar.
    pub fn total_bytes(&self) -> u64 {
        self.tensors
            .values()
            .map(|t| (t.end - t.begin) as u64)
            .sum()
    }

    /// Advances `bar` by each tensor's size as it is read.
    pub fn set_progress(&mut self, bar: ProgressBar) {
        self.progress = Some(bar);
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    fn read(&self, name: &str, t: &TensorEntry) -> Result<Array> {
        let shard = &self.shards[t.shard];
        let Some(dtype) = mlx_dtype(t.dtype) else {
            bail!(
                "tensor {name} in {}: dtype {:?} is not supported",
                shard.path.display(),
                t.dtype
            );
        };
        let bytes = &shard.map[shard.data_start + t.begin..shard.data_start + t.end];
        let shape: Vec<i32> = t
            .shape
            .iter()
            .map(|&d| i32::try_from(d))
            .collect::<Result<_, _>>()
            .with_context(|| format!("tensor {name}: a dimension exceeds i32"))?;
        // SAFETY: `bytes` holds exactly numel * itemsize bytes (checked in `add_shard`); MLX
        // copies them into its own buffer, so no alignment or lifetime requirement remains.
        let array = unsafe { Array::from_raw_data(bytes.as_ptr().cast(), &shape, dtype) };
        if let Some(bar) = &self.progress {
            bar.inc(bytes.len() as u64);
        }
        Ok(array)
    }
}

fn mlx_dtype(d: StDtype) -> Option<Dtype> {
    Some(match d {
        StDtype::F32 => Dtype::Float32,
        StDtype::F16 => Dtype::Float16,
        StDtype::BF16 => Dtype::Bfloat16,
        StDtype::U32 => Dtype::Uint32,
        StDtype::I32 => Dtype::Int32,
        StDtype::I64 => Dtype::Int64,
        StDtype::U8 => Dtype::Uint8,
        _ => return None,
    })
}

impl TensorSource for WeightStore {
    fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Reads tensor `name` as an MLX array in its stored dtype, checking its shape.
    fn array(&self, name: &str, expected_shape: &[usize]) -> Result<Array> {
        let t = self
            .tensors
            .get(name)
            .with_context(|| format!("tensor {name} is missing from the checkpoint"))?;
        if t.shape != expected_shape {
            bail!(
                "tensor {name} in {}: expected shape {expected_shape:?}, found {:?} (does config.json match the weights?)",
                self.shards[t.shard].path.display(),
                t.shape
            );
        }
        self.read(name, t)
    }

    fn dtype_of(&self, name: &str) -> Option<Dtype> {
        self.tensors.get(name).and_then(|t| mlx_dtype(t.dtype))
    }
}
