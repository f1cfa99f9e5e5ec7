//! Unicode helpers: GPT-2's byte <-> char map and general-category tests.

use std::sync::OnceLock;

use fancy_regex::Regex;

/// Bytes GPT-2 keeps as their own Latin-1 char; all others map to U+0100 and up.
fn is_printable_byte(b: u8) -> bool {
    matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF)
}

struct ByteMap {
    to_char: [char; 256],
    /// Indexed by `char as u32` for chars below U+0144 (the largest mapped char).
    from_char: Vec<Option<u8>>,
}

fn byte_map() -> &'static ByteMap {
    static MAP: OnceLock<ByteMap> = OnceLock::new();
    MAP.get_or_init(|| {
        let mut to_char = ['\0'; 256];
        let mut next_extra = 256u32;
        for b in 0..=255u8 {
            to_char[b as usize] = if is_printable_byte(b) {
                char::from(b)
            } else {
                next_extra += 1;
                char::from_u32(next_extra - 1).expect("U+0100..U+0143 are valid chars")
            };
        }
        let mut from_char = vec![None; next_extra as usize];
        for (b, c) in to_char.iter().enumerate() {
            from_char[*c as usize] = Some(b as u8);
        }
        ByteMap { to_char, from_char }
    })
}

/// GPT-2 byte-level encoding of raw bytes into printable chars.
pub(crate) fn bytes_to_unicode(bytes: &[u8]) -> String {
    let map = byte_map();
    bytes.iter().map(|&b| map.to_char[b as usize]).collect()
}

/// The byte a byte-level char stands for, `None` for chars outside the map.
pub(crate) fn unicode_to_byte(c: char) -> Option<u8> {
    byte_map().from_char.get(c as usize).copied().flatten()
}

/// C's `isspace` in the "C" locale, which llama.cpp uses to strip around special tokens.
pub(crate) fn is_c_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | 0x0B | 0x0C | b'\r')
}

/// General-category tests needed by the WordPiece normalizer.
pub(crate) struct CharClasses {
    control: Regex,
    mark: Regex,
    punctuation: Regex,
    symbol: Regex,
}

impl CharClasses {
    pub(crate) fn get() -> &'static CharClasses {
        static CLASSES: OnceLock<CharClasses> = OnceLock::new();
        CLASSES.get_or_init(|| {
            let class = |p: &str| Regex::new(&format!(r"\A\p{{{p}}}\z")).expect("valid category regex");
            CharClasses { control: class("C"), mark: class("M"), punctuation: class("P"), symbol: class("S") }
        })
    }

    fn test(re: &Regex, c: char) -> bool {
        let mut buf = [0u8; 4];
        // These patterns have no look-around, so the regex engine cannot fail on them.
        re.is_match(c.encode_utf8(&mut buf)).unwrap_or(false)
    }

    pub(crate) fn is_control(&self, c: char) -> bool {
        Self::test(&self.control, c)
    }
    pub(crate) fn is_mark(&self, c: char) -> bool {
        Self::test(&self.mark, c)
    }
    pub(crate) fn is_punctuation(&self, c: char) -> bool {
        Self::test(&self.punctuation, c)
    }
    pub(crate) fn is_symbol(&self, c: char) -> bool {
        Self::test(&self.symbol, c)
    }
}

/// Unicode simple lowercase mapping (one char to one char), as llama.cpp's table.
pub(crate) fn simple_lowercase(c: char) -> char {
    // Only U+0130 has a multi-char full lowercase; its simple mapping is the first char.
    c.to_lowercase().next().unwrap_or(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_map_is_a_bijection_with_gpt2_values() {
        let all: Vec<u8> = (0..=255).collect();
        let encoded = bytes_to_unicode(&all);
        let back: Vec<u8> = encoded.chars().map(|c| unicode_to_byte(c).unwrap()).collect();
        assert_eq!(back, all);
        // GPT-2's well-known assignments: space -> Ġ, newline -> Ċ, tab -> ĉ.
        assert_eq!(bytes_to_unicode(b" \n\t"), "ĠĊĉ");
        assert_eq!(bytes_to_unicode(b"a!"), "a!");
        assert_eq!(unicode_to_byte('€'), None);
    }

    #[test]
    fn categories() {
        let c = CharClasses::get();
        assert!(c.is_punctuation('!') && c.is_punctuation('、') && !c.is_punctuation('$'));
        assert!(c.is_symbol('$') && c.is_symbol('+') && !c.is_symbol('a'));
        assert!(c.is_mark('\u{301}') && c.is_mark('\u{FE0F}') && !c.is_mark('e'));
        assert!(c.is_control('\u{200D}') && c.is_control('\u{0}') && !c.is_control(' '));
        assert_eq!(simple_lowercase('Ä'), 'ä');
        assert_eq!(simple_lowercase('\u{130}'), 'i');
    }
}
