//! Helpers shared by the GPU test binaries.

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// A fresh seed per run, printed so a failure can be replayed.
pub fn rng(test: &str) -> ChaCha8Rng {
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64);
    eprintln!("{test}: seed {seed}");
    ChaCha8Rng::seed_from_u64(seed)
}
