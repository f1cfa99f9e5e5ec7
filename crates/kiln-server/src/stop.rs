//! Stop strings over streamed text: text that could still be the start of a stop string is
//! held back until it cannot be, so a client never sees any part of a stop string.

#[derive(Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

/// What one piece of text released.
#[derive(Debug, PartialEq, Eq)]
pub struct Released {
    pub text: String,
    /// A stop string was found; `text` ends right before it.
    pub stopped: bool,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> StopMatcher {
        StopMatcher { stops: stops.into_iter().filter(|s| !s.is_empty()).collect(), held: String::new() }
    }

    pub fn push(&mut self, piece: &str) -> Released {
        self.held.push_str(piece);
        // A stop longer than the held text cannot be in it (and searching costs its length).
        let first_stop = self.stops.iter().filter(|s| s.len() <= self.held.len()).filter_map(|s| self.held.find(s.as_str())).min();
        if let Some(at) = first_stop {
            let text = self.held[..at].to_string();
            self.held.clear();
            return Released { text, stopped: true };
        }
        // The earliest char boundary from which the rest is a proper prefix of a stop string.
        let keep_from = self
            .held
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| {
                let tail = &self.held[i..];
                self.stops.iter().any(|s| s.len() > tail.len() && s.starts_with(tail))
            })
            .unwrap_or(self.held.len());
        let text = self.held[..keep_from].to_string();
        self.held.drain(..keep_from);
        Released { text, stopped: false }
    }

    /// The held-back text, at the end of generation without a stop.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn released(text: &str, stopped: bool) -> Released {
        Released { text: text.into(), stopped }
    }

    #[test]
    fn stop_prefixes_are_held_back_until_decided() {
        let mut m = StopMatcher::new(vec!["END".into(), "\n\n".into()]);
        assert_eq!(m.push("hello E"), released("hello ", false));
        assert_eq!(m.push("N"), released("", false));
        assert_eq!(m.push("x"), released("ENx", false));
        assert_eq!(m.push(" a\n"), released(" a", false));
        assert_eq!(m.push("\nrest"), released("", true));
        let mut m = StopMatcher::new(vec!["END".into()]);
        assert_eq!(m.push("abcEN"), released("abc", false));
        assert_eq!(m.finish(), "EN");
    }

    #[test]
    fn the_earliest_stop_wins_and_multibyte_text_stays_whole() {
        let mut m = StopMatcher::new(vec!["é!".into(), "b".into()]);
        assert_eq!(m.push("aé"), released("a", false));
        assert_eq!(m.push("!b"), released("", true));
        let mut m = StopMatcher::new(vec!["zz".into(), "y".into()]);
        assert_eq!(m.push("xzzy"), released("x", true));
        let mut none = StopMatcher::new(vec![String::new()]);
        assert_eq!(none.push("text"), released("text", false));
    }
}
