//! Choices made by timing candidates (launch shapes, split counts): kept for the process and,
//! where the kernel cache has a directory, on disk beside the kernels, so that every later run
//! of the same binary on the same kind of GPU makes the same choices. Candidates sum in
//! different orders, so without this two runs of one prompt could differ in their last bits,
//! and greedy text wherever two logits are that close.
//!
//! An entry is `<kernel cache>/tuning/<hash>`, the hash over the GPU (name, multiprocessors,
//! target architecture), the binary (its size and modification time: a rebuilt binary tunes
//! afresh, so an entry never names a candidate another build numbers differently), the table
//! and the key. Its payload repeats the table and key, then the chosen value's words.

use std::collections::HashMap;
use std::fmt::Debug;
use std::hash::Hash;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::UNIX_EPOCH;

use sha2::{Digest, Sha256};

use crate::cache::{read_entry, write_entry};
use crate::CudaDevice;

/// A choice as a few integers.
pub(crate) trait Tunable: Copy {
    fn to_words(self) -> Vec<u64>;
    /// `None` for words that encode no value.
    fn from_words(words: &[u64]) -> Option<Self>;
}

impl Tunable for usize {
    fn to_words(self) -> Vec<u64> {
        vec![self as u64]
    }

    fn from_words(words: &[u64]) -> Option<Self> {
        match words {
            &[word] => usize::try_from(word).ok(),
            _ => None,
        }
    }
}

/// Choices by (GPU ordinal, key); `None` for a key looked up on disk and absent.
type Choices<K, V> = HashMap<(usize, K), Option<V>>;

/// One tuner's choices by key. A key's `Debug` text names it on disk.
pub(crate) struct TuningTable<K, V> {
    name: &'static str,
    /// Rejects a stored value this build cannot use (an index past its candidates).
    valid: fn(&V) -> bool,
    /// By GPU ordinal and key (every backend on one GPU shares them, so they sum in the same
    /// order; GPUs of two kinds in one process each keep their own). `None`: looked up on disk
    /// and absent, so a miss costs one read a process.
    choices: OnceLock<Mutex<Choices<K, V>>>,
}

impl<K: Copy + Eq + Hash + Debug, V: Tunable> TuningTable<K, V> {
    pub(crate) const fn new(name: &'static str, valid: fn(&V) -> bool) -> Self {
        TuningTable { name, valid, choices: OnceLock::new() }
    }

    fn choices(&self) -> std::sync::MutexGuard<'_, Choices<K, V>> {
        self.choices.get_or_init(Default::default).lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The choice for `key`: this process's, else the one an earlier run saved.
    pub(crate) fn get(&self, device: &CudaDevice, key: &K) -> Option<V> {
        let gpu = device.context().ordinal();
        if let Some(&known) = self.choices().get(&(gpu, *key)) {
            return known;
        }
        let stored = self.entry(device, key).and_then(|(path, label)| load(&path, &label)).and_then(|words| V::from_words(&words)).filter(self.valid);
        *self.choices().entry((gpu, *key)).or_insert(stored)
    }

    /// Remembers `value` for `key`, in the process and on disk.
    pub(crate) fn insert(&self, device: &CudaDevice, key: K, value: V) {
        self.choices().insert((device.context().ordinal(), key), Some(value));
        if let Some((path, label)) = self.entry(device, &key) {
            save(&path, &label, &value.to_words());
        }
    }

    /// The entry's file and the label its payload starts with; `None` without a cache directory.
    fn entry(&self, device: &CudaDevice, key: &K) -> Option<(PathBuf, String)> {
        let dir = device.registry().cubin_cache().dir()?.join("tuning");
        let info = device.info();
        let label = format!("{} {key:?}", self.name);
        let mut hasher = Sha256::new();
        for part in [info.name.as_str(), &info.multiprocessor_count.to_string(), device.registry().arch(), binary_identity()?, &label] {
            hasher.update((part.len() as u64).to_le_bytes());
            hasher.update(part.as_bytes());
        }
        let digest = hasher.finalize();
        let name: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
        Some((dir.join(name), label))
    }
}

/// The running binary's size and modification time; `None` where they cannot be read.
fn binary_identity() -> Option<&'static str> {
    static IDENTITY: OnceLock<Option<String>> = OnceLock::new();
    IDENTITY
        .get_or_init(|| {
            let meta = std::fs::metadata(std::env::current_exe().ok()?).ok()?;
            let modified = meta.modified().ok()?.duration_since(UNIX_EPOCH).ok()?;
            Some(format!("{} {}.{:09}", meta.len(), modified.as_secs(), modified.subsec_nanos()))
        })
        .as_deref()
}

fn load(path: &std::path::Path, label: &str) -> Option<Vec<u64>> {
    let payload = String::from_utf8(read_entry(path)?).ok()?;
    let (stored_label, words) = payload.split_once('\n')?;
    if stored_label != label {
        return None;
    }
    words.split_whitespace().map(|word| word.parse().ok()).collect()
}

fn save(path: &std::path::Path, label: &str, words: &[u64]) {
    let words: Vec<String> = words.iter().map(u64::to_string).collect();
    let payload = format!("{label}\n{}", words.join(" "));
    let written = path.parent().map_or(Ok(()), std::fs::create_dir_all).and_then(|()| write_entry(path, payload.as_bytes()));
    if let Err(error) = written {
        tracing::warn!(path = %path.display(), %error, "could not save a tuning choice");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_round_trip_and_reject_another_label() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tuning").join("entry");
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        save(&path, "mat-vec shapes TuneKey { rows: 7 }", &[3, 1 << 40]);
        assert_eq!(load(&path, "mat-vec shapes TuneKey { rows: 7 }"), Some(vec![3, 1 << 40]));
        assert_eq!(load(&path, "mat-vec shapes TuneKey { rows: 8 }"), None, "a hash collision must not hand over another key's choice");
        assert_eq!(load(&dir.path().join("absent"), "x"), None);
    }

    #[test]
    fn usize_words() {
        assert_eq!(usize::from_words(&7usize.to_words()), Some(7));
        assert_eq!(usize::from_words(&[]), None);
        assert_eq!(usize::from_words(&[1, 2]), None);
    }

    #[test]
    fn the_binary_has_an_identity() {
        let identity = binary_identity().expect("the test binary's metadata");
        assert!(identity.split(' ').count() == 2 && !identity.starts_with("0 "), "{identity}");
    }
}
