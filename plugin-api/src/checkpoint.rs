//! Reading named tensors out of safetensors files, for drafters that load checkpoints.
//!
//! A checkpoint folder holds `model.safetensors`, or shards listed by
//! `model.safetensors.index.json`, or (failing both) any `*.safetensors` files. Every file is
//! memory-mapped and its header checked before any tensor is read, so a truncated or corrupt
//! file is reported by name at load instead of failing (or panicking) halfway through. Every
//! error names the file and the tensor.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use mlx_rs::{Array, Dtype};
use safetensors::tensor::{Dtype as StDtype, SafeTensors};

struct MappedFile {
    path: PathBuf,
    map: Mmap,
    /// Where the data section starts (after the 8-byte length and the JSON header).
    data_start: usize,
}

/// Where one tensor's bytes are.
#[derive(Debug, Clone)]
struct Entry {
    file: usize,
    dtype: StDtype,
    shape: Vec<usize>,
    begin: usize,
    end: usize,
}

/// Every tensor of one checkpoint, by name.
pub struct Checkpoint {
    files: Vec<MappedFile>,
    entries: BTreeMap<String, Entry>,
}

impl Checkpoint {
    /// Opens the weights of a checkpoint folder.
    pub fn open_dir(dir: &Path) -> Result<Self, String> {
        let index = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if index.is_file() {
            let text = std::fs::read_to_string(&index)
                .map_err(|e| format!("cannot read {}: {e}", index.display()))?;
            let json: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| format!("{} is not valid JSON: {e}", index.display()))?;
            let map = json
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| format!("{} has no `weight_map` object", index.display()))?;
            let mut names = Vec::new();
            for (tensor, file) in map {
                let file = file.as_str().ok_or_else(|| {
                    format!("{}: the file of {tensor} is not a string", index.display())
                })?;
                names.push(file.to_owned());
            }
            names.sort();
            names.dedup();
            names.into_iter().map(|n| dir.join(n)).collect()
        } else if dir.join("model.safetensors").is_file() {
            vec![dir.join("model.safetensors")]
        } else {
            let listing = std::fs::read_dir(dir)
                .map_err(|e| format!("cannot list {}: {e}", dir.display()))?;
            let mut found: Vec<PathBuf> = listing
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            found.sort();
            found
        };
        if files.is_empty() {
            return Err(format!(
                "no weights in {}: expected model.safetensors or model.safetensors.index.json",
                dir.display()
            ));
        }
        let mut checkpoint = Checkpoint {
            files: Vec::new(),
            entries: BTreeMap::new(),
        };
        for file in files {
            checkpoint.add_file(file)?;
        }
        Ok(checkpoint)
    }

    /// Opens one safetensors file (the oracle's recordings, a single shard).
    pub fn open_file(path: &Path) -> Result<Self, String> {
        let mut checkpoint = Checkpoint {
            files: Vec::new(),
            entries: BTreeMap::new(),
        };
        checkpoint.add_file(path.to_path_buf())?;
        Ok(checkpoint)
    }

    fn add_file(&mut self, path: PathBuf) -> Result<(), String> {
        let file = File::open(&path).map_err(|e| format!("cannot open {}: {e}", path.display()))?;
        // An empty file cannot be mapped; say what it is rather than what mmap thinks.
        let len = file.metadata().map(|m| m.len()).unwrap_or(0);
        if len < 8 {
            return Err(format!(
                "{} is not a valid safetensors file ({len} bytes); is it truncated or corrupt?",
                path.display()
            ));
        }
        // SAFETY: a read-only map; a file rewritten while we read it can only give wrong
        // numbers, and every range below is checked against the map's length.
        let map = unsafe { Mmap::map(&file) }
            .map_err(|e| format!("cannot memory-map {}: {e}", path.display()))?;
        let (header_len, meta) = SafeTensors::read_metadata(&map).map_err(|e| {
            format!(
                "{} is not a valid safetensors file ({e}); is it truncated or corrupt?",
                path.display()
            )
        })?;
        let data_start = 8 + header_len;
        let index = self.files.len();
        for (name, info) in meta.tensors() {
            let (begin, end) = info.data_offsets;
            let numel = info
                .shape
                .iter()
                .try_fold(1usize, |n, &d| n.checked_mul(d))
                .ok_or_else(|| format!("{}: tensor {name} is too large", path.display()))?;
            let want = numel.saturating_mul(info.dtype.bitsize()) / 8;
            if end < begin || end - begin != want {
                return Err(format!(
                    "{}: tensor {name} has {} bytes but its shape {:?} and dtype {:?} need {want}",
                    path.display(),
                    end.saturating_sub(begin),
                    info.shape,
                    info.dtype
                ));
            }
            if data_start.saturating_add(end) > map.len() {
                return Err(format!(
                    "{}: tensor {name} ends at byte {} but the file has {} bytes (truncated?)",
                    path.display(),
                    data_start.saturating_add(end),
                    map.len()
                ));
            }
            if let Some(previous) = self.entries.get(&name) {
                return Err(format!(
                    "tensor {name} appears in both {} and {}",
                    self.files[previous.file].path.display(),
                    path.display()
                ));
            }
            self.entries.insert(
                name,
                Entry {
                    file: index,
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                    begin,
                    end,
                },
            );
        }
        self.files.push(MappedFile {
            path,
            map,
            data_start,
        });
        Ok(())
    }

    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    /// The stored shape of a tensor.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.entries.get(name).map(|e| e.shape.as_slice())
    }

    /// The stored MLX dtype of a tensor (`None`: absent or of a dtype MLX cannot hold).
    pub fn dtype(&self, name: &str) -> Option<Dtype> {
        self.entries.get(name).and_then(|e| mlx_dtype(e.dtype))
    }

    /// The file a tensor lives in, for messages.
    pub fn file_of(&self, name: &str) -> String {
        match self.entries.get(name) {
            Some(e) => self.files[e.file].path.display().to_string(),
            None => self.describe(),
        }
    }

    /// The checkpoint's files, for messages about a tensor that is missing.
    fn describe(&self) -> String {
        let names: Vec<String> = self
            .files
            .iter()
            .map(|f| f.path.display().to_string())
            .collect();
        names.join(", ")
    }

    /// A tensor in its stored dtype, after checking its shape.
    pub fn tensor(&self, name: &str, shape: &[usize]) -> Result<Array, String> {
        let entry = self.entry(name)?;
        if entry.shape != shape {
            return Err(format!(
                "tensor {name} in {}: expected shape {shape:?}, found {:?} (does config.json match the weights?)",
                self.files[entry.file].path.display(),
                entry.shape
            ));
        }
        self.read(name, entry)
    }

    /// A tensor in its stored dtype and shape, whatever they are.
    pub fn tensor_any_shape(&self, name: &str) -> Result<Array, String> {
        let entry = self.entry(name)?;
        self.read(name, entry)
    }

    fn entry(&self, name: &str) -> Result<&Entry, String> {
        self.entries
            .get(name)
            .ok_or_else(|| format!("tensor {name} is missing from {}", self.describe()))
    }

    fn read(&self, name: &str, entry: &Entry) -> Result<Array, String> {
        let file = &self.files[entry.file];
        let dtype = mlx_dtype(entry.dtype).ok_or_else(|| {
            format!(
                "tensor {name} in {}: dtype {:?} is not supported",
                file.path.display(),
                entry.dtype
            )
        })?;
        let shape: Vec<i32> = entry
            .shape
            .iter()
            .map(|&d| i32::try_from(d))
            .collect::<Result<_, _>>()
            .map_err(|_| {
                format!(
                    "tensor {name} in {}: a dimension exceeds i32",
                    file.path.display()
                )
            })?;
        let bytes = &file.map[file.data_start + entry.begin..file.data_start + entry.end];
        // SAFETY: `bytes` holds exactly numel * itemsize bytes (checked in `add_file`), and MLX
        // copies them into its own buffer, so neither alignment nor lifetime matters after.
        Ok(unsafe { Array::from_raw_data(bytes.as_ptr().cast(), &shape, dtype) })
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
        StDtype::I8 => Dtype::Int8,
        StDtype::BOOL => Dtype::Bool,
        _ => return None,
    })
}
