//! Randomly mutated real and synthetic files never make the reader panic.
//! `fuzzing::exercise` also reads every value and tensor byte of each file
//! that still parses and round-trips it through the writer.

mod common;

use common::{read, stories260k, synthetic_file, Rng};
use kiln_gguf::{fuzzing, GgufFile};

const INTERESTING: &[u64] = &[0, 1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 31, 32, 33, 255, 1 << 31, 1 << 32, 1 << 63, u64::MAX];

fn mutate(rng: &mut Rng, base: &[u8], hot_len: usize) -> Vec<u8> {
    let mut bytes = base.to_vec();
    for _ in 0..1 + rng.below(4) {
        if bytes.is_empty() {
            break;
        }
        // Mostly hit the header, where the parser's decisions are made.
        let span = if rng.below(10) < 9 { hot_len.min(bytes.len()) } else { bytes.len() };
        let at = rng.below(span);
        match rng.below(6) {
            0 => bytes[at] ^= 1 << rng.below(8),
            1 => bytes[at] = rng.next_u64() as u8,
            2 | 3 => {
                let mut value = INTERESTING[rng.below(INTERESTING.len())];
                if rng.below(4) == 0 {
                    value = value.wrapping_add(bytes.len() as u64);
                }
                let width = if rng.below(2) == 0 { 4 } else { 8 };
                let end = (at + width).min(bytes.len());
                bytes[at..end].copy_from_slice(&value.to_le_bytes()[..end - at]);
            }
            4 => bytes.truncate(at),
            _ => {
                let len = 1 + rng.below(64).min(bytes.len() - at - 1);
                if rng.below(2) == 0 {
                    bytes.drain(at..at + len);
                } else {
                    let chunk = bytes[at..at + len].to_vec();
                    bytes.splice(at..at, chunk);
                }
            }
        }
    }
    bytes
}

#[test]
fn mutated_files_never_panic() {
    let bases = [
        (synthetic_file(), 1500),
        (read(&stories260k()), 1500),
        (read(&kiln_testdata::path("models/tiny-qwen3-Q4_K.gguf")), 1000),
        (read(&kiln_testdata::path("tokenizer/ggml-vocab-bert-bge.gguf")), 300),
    ];
    let mut rng = Rng::new(0x5eed_6775f);
    let (mut parsed, mut rejected) = (0, 0);
    for (base, iterations) in &bases {
        let data_offset = GgufFile::from_bytes(base.clone()).unwrap().data_offset() as usize;
        assert!(fuzzing::exercise(base.clone()), "unmutated base must parse");
        for _ in 0..*iterations {
            let input = mutate(&mut rng, base, data_offset);
            if fuzzing::exercise(input) {
                parsed += 1;
            } else {
                rejected += 1;
            }
        }
    }
    // Both outcomes must be common, or the mutations are not probing anything.
    assert!(parsed > 200 && rejected > 2000, "parsed {parsed}, rejected {rejected}");
    eprintln!("mutations: {parsed} parsed, {rejected} rejected");
}
