//! Joins token bytes into text that never ends inside a UTF-8 character.

#[derive(Default)]
pub struct Utf8Assembler {
    pending: Vec<u8>,
}

impl Utf8Assembler {
    /// Adds a token's bytes; returns the whole characters completed (invalid bytes as U+FFFD).
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    out.push_str(std::str::from_utf8(&self.pending[..valid]).expect("validated prefix"));
                    match e.error_len() {
                        None => {
                            self.pending.drain(..valid);
                            return out;
                        }
                        Some(bad) => {
                            out.push('\u{FFFD}');
                            self.pending.drain(..valid + bad);
                        }
                    }
                }
            }
        }
    }

    /// What is left at the end (an unfinished character becomes U+FFFD).
    pub fn finish(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn characters_split_over_tokens_come_out_whole() {
        let mut a = super::Utf8Assembler::default();
        let euro = "€".as_bytes();
        assert_eq!(a.push(&euro[..1]), "");
        assert_eq!(a.push(&euro[1..2]), "");
        assert_eq!(a.push(&[euro[2], b'a']), "€a");
        assert_eq!(a.push(&[0xff, b'b']), "\u{FFFD}b");
        assert_eq!(a.push(&euro[..2]), "");
        assert_eq!(a.finish(), "\u{FFFD}");
    }
}
