//! A sparse mixture of experts' routing: from each token's router logits to the experts it goes
//! to and their weights, and from those to each expert's group of tokens, so that a step runs
//! each chosen expert once over all its tokens (its weights read once per step).
//!
//! The rule (HF Mixtral and Qwen3-MoE): softmax over the experts' logits, the `k` highest
//! probabilities (equal ones: the lower expert index first), renormalized to sum to 1 when the
//! model says so. Plain functions over numbers, tested without a model.

use duet_model::config::MoeConfig;

/// The tokens one expert computes in a step, and the weight of its output in each.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ExpertGroup {
    /// Rows of the step (tokens), ascending.
    pub rows: Vec<usize>,
    pub weights: Vec<f32>,
}

/// The experts a token goes to, best first, with their weights.
pub fn route_token(logits: &[f32], moe: &MoeConfig) -> Vec<(usize, f32)> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exp: Vec<f64> = logits.iter().map(|&l| ((l - max) as f64).exp()).collect();
    let total: f64 = exp.iter().sum();
    let mut order: Vec<usize> = (0..logits.len()).collect();
    // Stable: equal probabilities keep their index order.
    order.sort_by(|&a, &b| exp[b].total_cmp(&exp[a]));
    order.truncate(moe.experts_per_token);
    let picked: f64 = order.iter().map(|&e| exp[e]).sum();
    let denominator = if moe.normalize_top_k { picked } else { total };
    order
        .into_iter()
        .map(|e| (e, (exp[e] / denominator) as f32))
        .collect()
}

/// Each expert's group of tokens for a step whose router logits are `logits` (`rows × experts`,
/// row-major); experts no token chose have an empty group.
pub fn group_tokens(logits: &[f32], rows: usize, moe: &MoeConfig) -> Vec<ExpertGroup> {
    let mut groups = vec![ExpertGroup::default(); moe.num_experts];
    for row in 0..rows {
        let token = &logits[row * moe.num_experts..(row + 1) * moe.num_experts];
        for (expert, weight) in route_token(token, moe) {
            groups[expert].rows.push(row);
            groups[expert].weights.push(weight);
        }
    }
    groups
}

#[cfg(test)]
mod tests {
    use super::*;

    fn moe(k: usize, normalize: bool) -> MoeConfig {
        MoeConfig {
            num_experts: 4,
            experts_per_token: k,
            expert_intermediate_size: 8,
            normalize_top_k: normalize,
        }
    }

    #[test]
    fn the_top_k_by_softmax_renormalized_or_not() {
        let logits = [0.0f32, 2.0, 1.0, -1.0];
        let e: Vec<f64> = logits.iter().map(|&l| (l as f64).exp()).collect();
        let total: f64 = e.iter().sum();
        let picked = route_token(&logits, &moe(2, true));
        assert_eq!(picked.iter().map(|p| p.0).collect::<Vec<_>>(), [1, 2]);
        let (w1, w2) = (e[1] / (e[1] + e[2]), e[2] / (e[1] + e[2]));
        assert!((picked[0].1 as f64 - w1).abs() < 1e-6 && (picked[1].1 as f64 - w2).abs() < 1e-6);
        let plain = route_token(&logits, &moe(2, false));
        assert!((plain[0].1 as f64 - e[1] / total).abs() < 1e-6);
        assert!((plain[1].1 as f64 - e[2] / total).abs() < 1e-6);
    }

    #[test]
    fn equal_probabilities_go_to_the_lower_expert() {
        // Experts 2 and 3 tie at the top-2 boundary.
        let picked = route_token(&[0.0, 3.0, 1.0, 1.0], &moe(2, true));
        assert_eq!(picked.iter().map(|p| p.0).collect::<Vec<_>>(), [1, 2]);
        let picked = route_token(&[1.0, 1.0, 1.0, 1.0], &moe(3, false));
        assert_eq!(picked.iter().map(|p| p.0).collect::<Vec<_>>(), [0, 1, 2]);
        assert!(picked.iter().all(|p| (p.1 - 0.25).abs() < 1e-7));
    }

    #[test]
    fn tokens_are_grouped_by_expert_in_row_order() {
        let logits = [
            5.0, 4.0, 0.0, 0.0, // row 0: experts 0, 1
            0.0, 0.0, 5.0, 4.0, // row 1: experts 2, 3
            4.0, 0.0, 5.0, 0.0, // row 2: experts 2, 0
        ];
        let groups = group_tokens(&logits, 3, &moe(2, true));
        let rows: Vec<Vec<usize>> = groups.iter().map(|g| g.rows.clone()).collect();
        assert_eq!(rows, [vec![0, 2], vec![0], vec![1, 2], vec![1]]);
        // Each token's weights sum to 1.
        for row in 0..3 {
            let sum: f32 = groups
                .iter()
                .flat_map(|g| g.rows.iter().zip(&g.weights))
                .filter(|(r, _)| **r == row)
                .map(|(_, w)| w)
                .sum();
            assert!((sum - 1.0).abs() < 1e-6);
        }
    }
}
