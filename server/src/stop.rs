//! Releasing an answer's text as it grows: held back while it could still be the start of a
//! stop string, cut at the first one.

/// Releases text only when it cannot be the start of a stop string, and cuts at the first stop.
pub(crate) struct StopFilter {
    stops: Vec<String>,
    text: String,
    emitted: usize,
    pub(crate) hit: bool,
}

impl StopFilter {
    pub(crate) fn new(stops: Vec<String>) -> StopFilter {
        StopFilter {
            stops,
            text: String::new(),
            emitted: 0,
            hit: false,
        }
    }

    pub(crate) fn push(&mut self, delta: &str) -> String {
        if self.hit {
            return String::new();
        }
        self.text.push_str(delta);
        let found = self
            .stops
            .iter()
            .filter_map(|s| self.text.find(s.as_str()))
            .min();
        let mut end = match found {
            Some(i) => {
                self.hit = true;
                i
            }
            None => {
                let hold = self
                    .stops
                    .iter()
                    .map(|s| s.len().saturating_sub(1))
                    .max()
                    .unwrap_or(0);
                self.text.len().saturating_sub(hold)
            }
        };
        while end > self.emitted && !self.text.is_char_boundary(end) {
            end -= 1;
        }
        if end <= self.emitted {
            return String::new();
        }
        let out = self.text[self.emitted..end].to_string();
        self.emitted = end;
        out
    }

    /// The text released so far.
    pub(crate) fn sent(&self) -> &str {
        &self.text[..self.emitted]
    }

    pub(crate) fn finish(&mut self) -> String {
        if self.hit || self.emitted >= self.text.len() {
            return String::new();
        }
        let out = self.text[self.emitted..].to_string();
        self.emitted = self.text.len();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::StopFilter;

    #[test]
    fn stop_strings_cut_and_hold_back() {
        let mut f = StopFilter {
            stops: vec!["END".into()],
            text: String::new(),
            emitted: 0,
            hit: false,
        };
        let mut out = String::new();
        for d in ["Hello E", "N", "D and more"] {
            out.push_str(&f.push(d));
        }
        out.push_str(&f.finish());
        assert_eq!(out, "Hello ");
        let mut f = StopFilter {
            stops: vec!["xyz".into()],
            text: String::new(),
            emitted: 0,
            hit: false,
        };
        let mut out = f.push("abc x");
        out.push_str(&f.push("y!"));
        out.push_str(&f.finish());
        assert_eq!(out, "abc xy!");
    }
}
