//! The tokenizer rebuilt from GGUF metadata tokenizes exactly as the original tokenizer.json.

mod common;

use std::path::Path;

use common::*;
use refusion_engine::chat::Tokenizer;
use refusion_gguf::GgufFile;

const TEXTS: &[&str] = &[
    "Hello, world!",
    "def add(a, b):\n    return a + b\n\n\nprint(add(2, 3))",
    "  leading spaces and trailing   ",
    "Numbers: 1234567890 3.14159 1e-9 0x7fff",
    "Ünïcödé: café naïve résumé — “quotes” ‘single’ … ½ ∑ √",
    "decomposed: cafe\u{301} e\u{301}",
    "中文分词测试：今天天气很好。日本語のテキスト。한국어 텍스트",
    "emoji 🙂👍🏽🚀 and symbols ©®™",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<think>\nreasoning\n</think>\n\nanswer<|mask|><|mask|><|endoftext|>",
    "I'm sure they'll say it's fine, we've DONE it, you'd KNOW",
    "tabs\tand\r\nwindows\r\nnewlines\n\n\n",
    "",
];

fn check(gguf: &Path, tokenizer_json: &Path) {
    let file = GgufFile::open(gguf).unwrap();
    let ours = Tokenizer::from_gguf(&file.header).unwrap();
    let reference = tokenizers::Tokenizer::from_file(tokenizer_json).unwrap();
    for text in TEXTS {
        let want = reference.encode(*text, false).unwrap().get_ids().to_vec();
        let got = ours.encode(text).unwrap();
        assert_eq!(got, want, "{text:?}");
        let back = ours.decode(&got, false).unwrap();
        let want_back = reference.decode(&want, false).unwrap();
        assert_eq!(back, want_back, "{text:?}");
    }
}

#[test]
fn real_refusion_tokenizer_round_trips_through_gguf() {
    let tmp = tempfile::tempdir().unwrap();
    for layout in [TokLayout::Fast, TokLayout::Slow] {
        let dir = tmp.path().join(format!("{layout:?}"));
        build_refusion_vocab_checkpoint(&dir, layout);
        let out = tmp.path().join(format!("{layout:?}.gguf"));
        convert_quiet(&dir, &out, "q8_0");
        check(&out, &fixtures().join("tokenizers/refusion/tokenizer.json"));
        let file = GgufFile::open(&out).unwrap();
        let t = Tokenizer::from_gguf(&file.header).unwrap();
        assert_eq!(t.mask_id, Some(151670));
        assert_eq!(t.eos_id, Some(151645));
        assert_eq!(t.encode("<|mask|>").unwrap(), vec![151670]);
        assert!(t.is_special(151644));
        assert!(!t.is_special(151667), "<think> is not a control token");
        assert_eq!(t.decode(&[151644, 872, 151645], true).unwrap(), "user");
    }
}

#[test]
fn fixture_tokenizers_round_trip_through_gguf() {
    let tmp = tempfile::tempdir().unwrap();
    for name in ["pub-a", "pub-b", "pub-c"] {
        let out = tmp.path().join(format!("{name}.gguf"));
        convert_quiet(&fixture_model(name), &out, "q8_0");
        check(&out, &fixture_model(name).join("tokenizer.json"));
    }
}
