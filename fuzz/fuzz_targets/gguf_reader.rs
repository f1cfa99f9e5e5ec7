#![no_main]

use libfuzzer_sys::fuzz_target;

// Parses the input, touches every metadata value and tensor slice, and for
// inputs that parse checks that a write/read round trip is lossless.
fuzz_target!(|data: &[u8]| {
    kiln_gguf::fuzzing::exercise(data.to_vec());
});
