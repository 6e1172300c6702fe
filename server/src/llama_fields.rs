//! llama-server's request conventions that its native endpoints share (`/completion`,
//! `/infill`): `n_predict` and `seed` with -1 for "the default", and the slot and probability
//! fields, accepted at their values that change nothing and refused by name otherwise.

use super::api::ApiError;

/// `n_predict` as a token limit: -1 (or none) is the server's default.
pub(crate) fn n_predict(n: Option<i64>) -> Result<Option<u32>, ApiError> {
    match n {
        None | Some(-1) => Ok(None),
        Some(n) => u32::try_from(n).map(Some).map_err(|_| {
            ApiError::bad_request(format!(
                "n_predict must be a number of tokens (0 or more) or -1, not {n}"
            ))
            .param("n_predict")
        }),
    }
}

/// `seed`: -1 (or none) is a random one.
pub(crate) fn seed(s: Option<i64>) -> Result<Option<u64>, ApiError> {
    match s {
        None | Some(-1) => Ok(None),
        Some(s) => u64::try_from(s).map(Some).map_err(|_| {
            ApiError::bad_request(format!("seed must be -1 or 0 or more, not {s}")).param("seed")
        }),
    }
}

/// `id_slot` (-1: any) and `n_probs` (0: none): a pinned slot or token probabilities are
/// refused by name.
pub(crate) fn refuse_slot_and_probs(
    id_slot: Option<i64>,
    n_probs: Option<u32>,
) -> Result<(), ApiError> {
    let bad = |m: &str, p: &str| Err(ApiError::bad_request(m.to_string()).param(p));
    if id_slot.is_some_and(|s| s != -1) {
        return bad(
            "id_slot is not supported: requests share the slots as the scheduler places them (send -1)",
            "id_slot",
        );
    }
    if n_probs.is_some_and(|n| n > 0) {
        return bad(
            "n_probs is not supported: slot decoding commits tokens verified or infilled in parallel, whose probabilities are not left-to-right log-probabilities",
            "n_probs",
        );
    }
    Ok(())
}
