//! Cache keys and the on-disk CUBIN cache.
//!
//! An entry is `<dir>/<source>-<hash>.cubin`, where the hash covers everything that shapes the
//! binary: the source and header text, the sorted defines, the architecture, the NVRTC version,
//! the compile options and `FORMAT_VERSION`. Entries are written to a unique temporary file in
//! the same directory, fsynced, then renamed into place, so concurrent processes never see a
//! partial entry. Each entry carries a header with a SHA-256 of its payload; anything that
//! fails to validate is deleted and recompiled.

use std::fs::{self, File, OpenOptions};
use std::hash::{Hash, Hasher};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use sha2::{Digest, Sha256};

use crate::nvrtc::{compile_key, compile_options, nvrtc_version};
use crate::sources::{find_source, hash_text, KernelSource};
use crate::CudaError;

/// Bump when the entry layout or the meaning of the key changes.
const FORMAT_VERSION: u32 = 1;
const MAGIC: &[u8; 8] = b"KILNCUBN";
/// magic, format version, reserved, payload length, payload SHA-256.
const HEADER_LEN: usize = 8 + 4 + 4 + 8 + 32;

/// Identifies one compiled module: source (name and content digest), sorted defines and arch.
#[derive(Clone, Debug)]
pub struct CubinKey {
    source: &'static KernelSource,
    source_digest: [u8; 32],
    defines: Vec<(String, i64)>,
    arch: String,
}

impl CubinKey {
    /// Validates the source name, the defines (C identifiers, no duplicates) and the arch.
    pub fn new(source: &str, defines: &[(&str, i64)], arch: &str) -> Result<Self, CudaError> {
        let source = find_source(source)?;
        validate_arch(arch)?;
        let mut sorted: Vec<(String, i64)> = Vec::with_capacity(defines.len());
        for &(name, value) in defines {
            validate_define_name(name)?;
            sorted.push((name.to_string(), value));
        }
        sorted.sort();
        if let Some(pair) = sorted.windows(2).find(|pair| pair[0].0 == pair[1].0) {
            return Err(CudaError::InvalidDefine { name: pair[0].0.clone(), reason: "defined more than once" });
        }
        Ok(CubinKey { source, source_digest: source.digest(), defines: sorted, arch: arch.to_string() })
    }

    pub fn source(&self) -> &'static KernelSource {
        self.source
    }

    /// Sorted by name.
    pub fn defines(&self) -> &[(String, i64)] {
        &self.defines
    }

    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// The disk-cache file name for this key when compiled by NVRTC `nvrtc_version`.
    pub fn file_name(&self, nvrtc_version: (i32, i32)) -> String {
        let mut hasher = Sha256::new();
        hasher.update(FORMAT_VERSION.to_le_bytes());
        hasher.update(nvrtc_version.0.to_le_bytes());
        hasher.update(nvrtc_version.1.to_le_bytes());
        hasher.update(self.source_digest);
        for option in compile_options(self) {
            hash_text(&mut hasher, &option);
        }
        let digest = hasher.finalize();
        let hex: String = digest[..16].iter().map(|byte| format!("{byte:02x}")).collect();
        format!("{}-{hex}.cubin", self.source.name)
    }
}

impl PartialEq for CubinKey {
    fn eq(&self, other: &Self) -> bool {
        self.source.name == other.source.name && self.source_digest == other.source_digest && self.defines == other.defines && self.arch == other.arch
    }
}

impl Eq for CubinKey {}

impl Hash for CubinKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.source.name.hash(state);
        self.source_digest.hash(state);
        self.defines.hash(state);
        self.arch.hash(state);
    }
}

/// Real architectures only (`sm_90`, `sm_90a`, `sm_100f`): NVRTC emits CUBIN for nothing else.
pub(crate) fn validate_arch(arch: &str) -> Result<(), CudaError> {
    let digits = arch.strip_prefix("sm_").map(|rest| rest.trim_end_matches(['a', 'f']));
    match digits {
        Some(d) if (2..=4).contains(&d.len()) && d.bytes().all(|b| b.is_ascii_digit()) => Ok(()),
        _ => Err(CudaError::InvalidArch { arch: arch.to_string() }),
    }
}

fn validate_define_name(name: &str) -> Result<(), CudaError> {
    let invalid = |reason| Err(CudaError::InvalidDefine { name: name.to_string(), reason });
    let mut bytes = name.bytes();
    match bytes.next() {
        None => invalid("the name is empty"),
        Some(first) if first.is_ascii_digit() => invalid("a name cannot start with a digit"),
        Some(first) if !(first.is_ascii_alphanumeric() || first == b'_') || !bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_') => {
            invalid("a name may use only ASCII letters, digits and `_`")
        }
        Some(_) => Ok(()),
    }
}

/// Where compiled CUBINs are kept between runs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum CacheDir {
    /// `$KILN_CACHE_DIR`, else `$XDG_CACHE_HOME/kiln/kernels`, else `~/.cache/kiln/kernels`.
    #[default]
    Default,
    At(PathBuf),
    /// Compile in every process; keep modules in memory only.
    MemoryOnly,
}

impl CacheDir {
    pub fn resolve(&self) -> Option<PathBuf> {
        let from_env = |name: &str| std::env::var_os(name).filter(|value| !value.is_empty()).map(PathBuf::from);
        match self {
            CacheDir::At(path) => Some(path.clone()),
            CacheDir::MemoryOnly => None,
            CacheDir::Default => from_env("KILN_CACHE_DIR")
                .or_else(|| from_env("XDG_CACHE_HOME").filter(|p| p.is_absolute()).map(|p| p.join("kiln/kernels")))
                .or_else(|| from_env("HOME").map(|home| home.join(".cache/kiln/kernels"))),
        }
    }
}

/// Where a CUBIN handed out by [`CubinCache::get_or_compile`] came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CubinOrigin {
    Disk,
    Compiled,
}

#[derive(Clone, Debug)]
pub struct Cubin {
    pub bytes: Vec<u8>,
    pub origin: CubinOrigin,
}

/// Compiles CUBINs through NVRTC, reusing valid entries of the disk cache. Device-free.
#[derive(Debug)]
pub struct CubinCache {
    dir: Option<PathBuf>,
}

impl CubinCache {
    /// A directory that cannot be created or written degrades to memory-only, with a warning.
    pub fn new(location: &CacheDir) -> Self {
        let dir = location.resolve();
        let dir = match &dir {
            Some(path) => match probe_writable(path) {
                Ok(()) => dir,
                Err(error) => {
                    tracing::warn!(dir = %path.display(), %error, "kernel cache directory is not writable; caching in memory only");
                    None
                }
            },
            None => {
                if *location == CacheDir::Default {
                    tracing::warn!("no KILN_CACHE_DIR, XDG_CACHE_HOME or HOME; caching kernels in memory only");
                }
                None
            }
        };
        CubinCache { dir }
    }

    /// The directory in use; `None` when caching in memory only.
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// The file that does or would hold `key`'s entry.
    pub fn entry_path(&self, key: &CubinKey) -> Result<Option<PathBuf>, CudaError> {
        let version = nvrtc_version()?;
        Ok(self.dir.as_ref().map(|dir| dir.join(key.file_name(version))))
    }

    pub fn get_or_compile(&self, key: &CubinKey) -> Result<Cubin, CudaError> {
        let path = self.entry_path(key)?;
        if let Some(bytes) = path.as_deref().and_then(read_entry) {
            return Ok(Cubin { bytes, origin: CubinOrigin::Disk });
        }
        let bytes = compile_key(key)?;
        if let Some(path) = &path {
            if let Err(error) = write_entry(path, &bytes) {
                tracing::warn!(path = %path.display(), %error, "could not write the kernel cache entry");
            }
        }
        Ok(Cubin { bytes, origin: CubinOrigin::Compiled })
    }
}

fn probe_writable(dir: &Path) -> std::io::Result<()> {
    fs::create_dir_all(dir)?;
    let (probe_path, file) = create_temp_file(dir, "probe")?;
    drop(file);
    fs::remove_file(probe_path)
}

/// A new file with a name unique across processes and threads.
fn create_temp_file(dir: &Path, stem: &str) -> std::io::Result<(PathBuf, File)> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    loop {
        let serial = COUNTER.fetch_add(1, Ordering::Relaxed);
        let path = dir.join(format!(".{stem}.{}.{serial}.tmp", std::process::id()));
        match OpenOptions::new().write(true).create_new(true).open(&path) {
            Ok(file) => return Ok((path, file)),
            // Left behind by a crashed process that had the same id.
            Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(error) => return Err(error),
        }
    }
}

/// The payload of a valid entry; a missing entry gives `None`, an invalid one is deleted.
pub(crate) fn read_entry(path: &Path) -> Option<Vec<u8>> {
    let data = match fs::read(path) {
        Ok(data) => data,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return None,
        Err(error) => {
            tracing::warn!(path = %path.display(), %error, "cannot read the cache entry; ignoring it");
            return None;
        }
    };
    match decode_entry(&data) {
        Ok(payload) => Some(payload.to_vec()),
        Err(problem) => {
            tracing::warn!(path = %path.display(), problem, "corrupt cache entry; deleting it");
            if let Err(error) = fs::remove_file(path) {
                tracing::warn!(path = %path.display(), %error, "cannot delete the corrupt cache entry");
            }
            None
        }
    }
}

fn encode_entry(payload: &[u8]) -> Vec<u8> {
    let mut data = Vec::with_capacity(HEADER_LEN + payload.len());
    data.extend_from_slice(MAGIC);
    data.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    data.extend_from_slice(&0u32.to_le_bytes());
    data.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    data.extend_from_slice(&Sha256::digest(payload));
    data.extend_from_slice(payload);
    data
}

fn decode_entry(data: &[u8]) -> Result<&[u8], &'static str> {
    if data.len() < HEADER_LEN {
        return Err("shorter than its header");
    }
    let (header, payload) = data.split_at(HEADER_LEN);
    if &header[..8] != MAGIC {
        return Err("bad magic");
    }
    if header[8..12] != FORMAT_VERSION.to_le_bytes() {
        return Err("unknown format version");
    }
    if header[12..16] != [0; 4] {
        return Err("reserved header bytes are not zero");
    }
    if header[16..24] != (payload.len() as u64).to_le_bytes() {
        return Err("payload length differs from the header (truncated?)");
    }
    if header[24..56] != Sha256::digest(payload)[..] {
        return Err("payload checksum mismatch");
    }
    Ok(payload)
}

pub(crate) fn write_entry(path: &Path, payload: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let stem = path.file_name().map_or("entry".into(), |name| name.to_string_lossy());
    let (temp_path, mut file) = create_temp_file(dir, &stem)?;
    let written = file.write_all(&encode_entry(payload)).and_then(|()| file.sync_all()).and_then(|()| fs::rename(&temp_path, path));
    if written.is_err() {
        let _ = fs::remove_file(&temp_path);
    }
    written
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_roundtrip_and_corruption_detection() {
        let payload: Vec<u8> = (0..1000u32).map(|i| (i * 7 + 3) as u8).collect();
        let entry = encode_entry(&payload);
        assert_eq!(decode_entry(&entry), Ok(&payload[..]));
        let every_header_byte = 0..HEADER_LEN;
        for index in every_header_byte.chain([HEADER_LEN, HEADER_LEN + 500, entry.len() - 1]) {
            let mut flipped = entry.clone();
            flipped[index] ^= 0x10;
            assert!(decode_entry(&flipped).is_err(), "flip at byte {index} went unnoticed");
        }
        for len in [0, HEADER_LEN - 1, HEADER_LEN, entry.len() - 1] {
            assert!(decode_entry(&entry[..len]).is_err(), "truncation to {len} bytes went unnoticed");
        }
    }

    #[test]
    fn arch_and_define_validation() {
        for good in ["sm_90", "sm_90a", "sm_100f", "sm_120"] {
            assert!(validate_arch(good).is_ok(), "{good}");
        }
        for bad in ["", "sm90", "compute_90", "sm_", "sm_9x", "sm_90ab", "sm_1"] {
            assert!(matches!(validate_arch(bad), Err(CudaError::InvalidArch { .. })), "{bad}");
        }
        for good in ["A", "_x", "BLOCK_SIZE", "n2"] {
            assert!(validate_define_name(good).is_ok(), "{good}");
        }
        for bad in ["", "2x", "A B", "A=1", "é", "-D"] {
            assert!(matches!(validate_define_name(bad), Err(CudaError::InvalidDefine { .. })), "{bad}");
        }
    }

    #[test]
    fn cache_dir_resolution_prefers_explicit_paths() {
        let explicit = PathBuf::from("/some/where");
        assert_eq!(CacheDir::At(explicit.clone()).resolve(), Some(explicit));
        assert_eq!(CacheDir::MemoryOnly.resolve(), None);
    }

    #[test]
    fn unwritable_cache_dir_degrades_to_memory_only() {
        let dir = tempfile::tempdir().expect("temp dir");
        let blocker = dir.path().join("a-file");
        fs::write(&blocker, b"x").expect("write");
        // A directory cannot be created below a regular file.
        let cache = CubinCache::new(&CacheDir::At(blocker.join("kernels")));
        assert_eq!(cache.dir(), None);
        let cache = CubinCache::new(&CacheDir::At(dir.path().join("kernels")));
        assert_eq!(cache.dir(), Some(dir.path().join("kernels").as_path()));
        let leftovers: Vec<_> = fs::read_dir(dir.path().join("kernels")).expect("read dir").collect();
        assert!(leftovers.is_empty(), "the writability probe left files behind");
    }
}
