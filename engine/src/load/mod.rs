//! Loading a model to run: the memory plan ([`plan`]: what fits where, before anything is
//! read), the Hugging Face Hub ([`hub`]: `-hf` repositories resolved to a cached file), and
//! the load itself ([`runtime`]: the GGUF map, the weights on their device, the tokenizer and
//! the KV cache, with the notes a front end shows).

pub mod hub;
pub mod plan;
pub mod runtime;

use std::fmt;
use std::sync::Arc;

/// Where loading's lines go: the memory plan, the load line, and the warnings on the way (`-ngl`
/// without a GPU, a context beyond the trained one, a Hub that cannot be reached). The engine
/// never prints; a front end says where they go (the command line: stderr, as they happen, so
/// that the plan shows before a long load).
#[derive(Clone)]
pub struct Notes(Option<Arc<Sink>>);

type Sink = dyn Fn(&str) + Send + Sync;

impl Notes {
    /// Every line to `sink`, in order.
    pub fn to(sink: impl Fn(&str) + Send + Sync + 'static) -> Notes {
        Notes(Some(Arc::new(sink)))
    }

    /// Nowhere (an embedder that reads the plan from [`runtime::Loaded`] instead).
    pub fn silent() -> Notes {
        Notes(None)
    }

    pub(crate) fn say(&self, line: &str) {
        if let Some(sink) = &self.0 {
            sink(line);
        }
    }
}

impl Default for Notes {
    fn default() -> Notes {
        Notes::silent()
    }
}

impl fmt::Debug for Notes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_some() {
            "Notes(to a sink)"
        } else {
            "Notes(silent)"
        })
    }
}
