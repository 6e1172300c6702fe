//! Entry points for the fuzz targets in `fuzz/` and for replaying their corpora in tests: each
//! takes arbitrary bytes and must return without panicking, hanging or allocating without bound.

use refusion_gguf::{GgufHeader, Value, ValueType};

use refusion_engine::chat::{ChatTemplate, Message, Tokenizer};
use refusion_engine::decode::DecodeParams;
use refusion_server::api::{parse, ChatRequest, CompletionRequest};

/// The GGUF reader: header, metadata, tensor infos, offsets, alignment.
pub fn gguf_header(data: &[u8]) {
    if let Ok(h) = GgufHeader::parse(data) {
        // Whatever parsed must be internally consistent.
        for t in &h.tensors {
            assert!(t.offset % h.alignment == 0);
            assert!(h.data_offset + t.offset + t.n_bytes <= data.len() as u64);
        }
        let _ = refusion_engine::model::Qwen3Config::from_gguf(&h);
        let _ = Tokenizer::from_gguf(&h);
    }
}

/// The safetensors header and the shard index.
pub fn safetensors(data: &[u8]) {
    if let Ok(tensors) = refusion_convert::hf::weights::parse_shard(data, 0) {
        for t in tensors {
            assert!(t.start + t.len <= data.len());
        }
    }
    let _ = refusion_convert::hf::weights::parse_index(data);
}

/// A tokenizer built from hostile `tokenizer.ggml.*` metadata: lines of the input are tokens
/// (the first byte of a line picks its type), lines after an empty line are merges.
pub fn tokenizer_metadata(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let mut tokens = Vec::new();
    let mut types = Vec::new();
    let mut merges = Vec::new();
    let mut in_merges = false;
    for line in text.split('\n').take(4096) {
        if line.is_empty() {
            in_merges = true;
            continue;
        }
        if in_merges {
            merges.push(Value::String(line.to_string()));
        } else {
            let ty = match line.as_bytes()[0] % 7 {
                0 => 3,
                1 => 4,
                2 => 5,
                _ => 1,
            };
            tokens.push(Value::String(line.to_string()));
            types.push(Value::I32(ty));
        }
    }
    let n = tokens.len() as u32;
    let metadata = vec![
        (
            "tokenizer.ggml.model".to_string(),
            Value::String("gpt2".into()),
        ),
        (
            "tokenizer.ggml.pre".to_string(),
            Value::String("qwen2".into()),
        ),
        (
            "tokenizer.ggml.tokens".to_string(),
            Value::Array(ValueType::String, tokens),
        ),
        (
            "tokenizer.ggml.token_type".to_string(),
            Value::Array(ValueType::I32, types),
        ),
        (
            "tokenizer.ggml.merges".to_string(),
            Value::Array(ValueType::String, merges),
        ),
        (
            "tokenizer.ggml.eos_token_id".to_string(),
            Value::U32(n.saturating_sub(1)),
        ),
    ];
    let h = GgufHeader {
        version: 3,
        metadata,
        tensors: Vec::new(),
        alignment: 32,
        data_offset: 0,
    };
    if let Ok(t) = Tokenizer::from_gguf(&h) {
        for s in [
            "Hello, world!",
            "  spaces\tand\nlines ",
            "ünïcödé 中文 🙂",
            &text[..text.len().min(256)],
        ] {
            if let Ok(ids) = t.encode(s) {
                let _ = t.decode(&ids, false);
            }
        }
    }
}

/// Chat-template rendering of an untrusted template (bounded by fuel and output size).
pub fn chat_template(data: &[u8]) {
    let Ok(src) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(t) = ChatTemplate::new(src) {
        let msgs = [
            Message::new("system", "s"),
            Message::new("user", "Hello"),
            Message::new("assistant", "Hi"),
        ];
        let _ = t.render(&msgs, true);
    }
}

/// The server's request parsing and validation.
pub fn server_request(data: &[u8]) {
    let base = DecodeParams::new(refusion_gguf::DecodingDefaults::default(), 1, 2);
    if let Ok(r) = parse::<ChatRequest>(data) {
        for m in &r.messages {
            let _ = m.content.text();
        }
        let _ = r.knobs.params(&base, 4096);
    }
    if let Ok(r) = parse::<CompletionRequest>(data) {
        let _ = r.knobs.params(&base, 4096);
    }
}

/// ReFusion's `refusion.*` metadata and the decoding values over them: the first bytes pick
/// each key's type (or its absence) and value, the rest are the flags' and a request's values.
/// Whatever is accepted must give sizes that fit, and a decoder that starts.
pub fn decoding_values(data: &[u8]) {
    use refusion_gguf::decoding::*;
    let mut bytes = data.iter().copied().chain(std::iter::repeat(0));
    let mut word = || {
        let mut b = [0u8; 8];
        for x in &mut b {
            *x = bytes.next().unwrap_or(0);
        }
        u64::from_le_bytes(b)
    };
    let mut metadata = Vec::new();
    for key in [
        KEY_GEN_LENGTH,
        KEY_SLOT_SIZE,
        KEY_SERIAL_BLOCKS,
        KEY_SLOT_THRESHOLD,
        KEY_TOKEN_THRESHOLD,
    ] {
        let (pick, v) = (word(), word());
        let value = match pick % 8 {
            0 => continue,
            1 => Value::U32(v as u32),
            2 => Value::U64(v),
            3 => Value::I64(v as i64),
            4 => Value::I32(v as i32),
            5 => Value::F32(f32::from_bits(v as u32)),
            6 => Value::F64(f64::from_bits(v)),
            _ => Value::U8(v as u8),
        };
        metadata.push((key.to_string(), value));
    }
    let h = GgufHeader {
        version: 3,
        metadata,
        tensors: Vec::new(),
        alignment: 32,
        data_offset: 0,
    };
    let Ok(d) = DecodingDefaults::from_metadata(&h) else {
        return;
    };
    let mut p = DecodeParams::new(d, 1, 2);
    let flags = [word(), word(), word()];
    let block = p.block_len();
    if flags[0] % 2 == 1 {
        p.gen_length = (flags[0] >> 1) as u32;
        p.fit_serial_blocks(block);
    }
    if flags[1] % 2 == 1 {
        p.slot_size = (flags[1] >> 1) as u32;
    }
    if flags[2] % 2 == 1 {
        p.serial_blocks = (flags[2] >> 1) as u32;
    }
    let _ = (p.padded_gen_length(), p.block_len(), p.dropped_tail());
    let max_gen_length = (word() as u32).clamp(1, MAX_TOKENS);
    let overrides = refusion_engine::decode::Overrides {
        max_tokens: Some(word() as u32),
        slot_size: Some(word() as u32),
        serial_blocks: Some(word() as u32),
        ..Default::default()
    };
    let _ = overrides.apply(&p, max_gen_length);
    let prompt = [3u32, 4, 5];
    if refusion_engine::decode::check(&prompt, &p, 16, 4 * MAX_TOKENS as usize).is_ok() {
        assert!(p.padded_gen_length() <= 2 * MAX_TOKENS);
        let mut decoder = refusion_engine::decode::start(&prompt, 0, &p);
        let _ = decoder.poll(&mut |_| {});
    }
}
