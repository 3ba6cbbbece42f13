"""Chapter 2, the geometry of an attention output: small worked examples in two and three dimensions and
random heads, with their figures."""
from __future__ import annotations

from dataclasses import dataclass

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns
from scipy.stats import kendalltau

from cwcore.plotting import palette

COLOURS = palette(10)
ATTN, CONTRIB, OUTPUT = COLOURS[0], COLOURS[1], "black"
TOKEN = [COLOURS[k] for k in (2, 4, 8, 5, 9, 6, 3, 7)]  # one colour per token


def decompose(alpha, V):
    """The output and contribution weights of one query: ``alpha [n]``, ``V [n, d]`` -> ``(o [d], c [n],
    ||v_j||/||o|| [n], cos(o, v_j) [n])`` with ``c = alpha * relative norm * cos``, in float64."""
    # o = sum_j alpha_j v_j;  c_j = alpha_j * ||v_j||/||o|| * cos(o, v_j)
    alpha, V = np.asarray(alpha, float), np.asarray(V, float)
    o = alpha @ V
    norm_o, norm_v = np.linalg.norm(o), np.linalg.norm(V, axis=1)
    rel_norm = norm_v / norm_o
    cos = V @ o / (norm_v * norm_o)
    c = alpha * rel_norm * cos  # == alpha * <o, v_j> / ||o||^2
    return o, c, rel_norm, cos


@dataclass(frozen=True)
class Arrows:
    """Three tokens in two dimensions: ``alpha [3]``, ``V [3, 2]``, the output ``o [2]``, contribution
    weights ``c [3]``, their factors ``rel_norm``, ``cos`` ``[3]``, and ``table`` (one row per token and
    a ``sum`` row)."""
    alpha: np.ndarray
    V: np.ndarray
    o: np.ndarray
    c: np.ndarray
    rel_norm: np.ndarray
    cos: np.ndarray
    table: pd.DataFrame


@dataclass(frozen=True)
class Interference:
    """Two tokens with equal attention ``alpha [2]``, their values pointing the same way (``V_con``,
    constructive) or almost opposite (``V_des``, destructive), ``[2, 2]`` each; outputs ``o_*`` ``[2]``
    and weights ``c_*`` ``[2]``."""
    alpha: np.ndarray
    V_con: np.ndarray
    V_des: np.ndarray
    o_con: np.ndarray
    c_con: np.ndarray
    o_des: np.ndarray
    c_des: np.ndarray
    rel_des: np.ndarray
    cos_des: np.ndarray


@dataclass(frozen=True)
class Sweep:
    """The destructive pair as attention ``a`` on token 1 moves from 0 to 1: ``a [401]``, ``norms``
    ``||o(a)|| [401]``, ``c [401, 2]``; ``a_star`` minimises the norm (``min_norm``), clipped to [0, 1]."""
    a: np.ndarray
    norms: np.ndarray
    c: np.ndarray
    a_star: float
    min_norm: float


@dataclass(frozen=True)
class Sink:
    """Eight tokens in three dimensions, token 1 a sink (short, against the others, most attended):
    ``alpha [8]``, ``V [8, 3]``, ``o [3]``, ``c``, ``rel_norm``, ``cos`` ``[8]``, Kendall ``tau`` of
    alpha and c, and ``table`` (one row per token, with both rankings)."""
    alpha: np.ndarray
    V: np.ndarray
    o: np.ndarray
    c: np.ndarray
    rel_norm: np.ndarray
    cos: np.ndarray
    tau: float
    table: pd.DataFrame


@dataclass(frozen=True)
class RandomHeads:
    """``n_trials`` random heads of 8 tokens in 16 dimensions: attention ``A`` and contribution weights
    ``C`` ``[trial, token]``, and per head the Kendall ``taus [trial]`` of the two rankings."""
    A: np.ndarray
    C: np.ndarray
    taus: np.ndarray

    @property
    def sum_err(self) -> float:
        """Largest deviation of a head's weights' sum from one (rounding error)."""
        return float(np.abs(self.C.sum(1) - 1).max())

    @property
    def frac_top_differs(self) -> float:
        return float(np.mean(self.A.argmax(1) != self.C.argmax(1)))

    @property
    def frac_negative(self) -> float:
        return float(np.mean((self.C < 0).any(1)))

    @property
    def frac_above_one(self) -> float:
        return float(np.mean((self.C > 1).any(1)))

    @property
    def median_tau(self) -> float:
        return float(np.median(self.taus))


@dataclass(frozen=True)
class GeometryResult:
    """Chapter 2's examples, in page order."""
    arrows: Arrows
    interference: Interference
    sweep: Sweep
    sink: Sink
    random_heads: RandomHeads


def sum_of_arrows() -> Arrows:
    alpha = np.array([0.5, 0.3, 0.2])
    V = np.array([[2.0, 0.4], [0.6, 1.8], [-1.6, 0.5]])
    o, c, rel, cos = decompose(alpha, V)
    table = pd.DataFrame({"attention α": alpha, "relative norm ‖v‖/‖o‖": rel, "alignment cos": cos,
                          "contribution c": c}, index=[f"token {j + 1}" for j in range(3)])
    table.loc["sum"] = [alpha.sum(), np.nan, np.nan, c.sum()]
    return Arrows(alpha, V, o, c, rel, cos, table)


def interference() -> Interference:
    alpha = np.array([0.5, 0.5])
    V_con = np.array([[1.6, 1.4], [1.7, 0.5]])
    V_des = np.array([[1.6, 1.4], [-1.3, -0.7]])
    o_con, c_con, *_ = decompose(alpha, V_con)
    o_des, c_des, rel_des, cos_des = decompose(alpha, V_des)
    return Interference(alpha, V_con, V_des, o_con, c_con, o_des, c_des, rel_des, cos_des)


def sweep(V_des) -> Sweep:
    a = np.linspace(0, 1, 401)
    v1, v2 = V_des
    outs = a[:, None] * v1 + (1 - a[:, None]) * v2
    norms = np.linalg.norm(outs, axis=1)
    c_sweep = np.stack([a * (outs @ v1), (1 - a) * (outs @ v2)], axis=1)
    c_sweep /= norms[:, None] ** 2
    # ||o(a)||^2 is a quadratic in a: its minimum, clipped to [0, 1]
    a_star = np.clip(-(v2 @ (v1 - v2)) / np.sum((v1 - v2) ** 2), 0, 1)
    return Sweep(a, norms, c_sweep, a_star, np.linalg.norm(a_star * v1 + (1 - a_star) * v2))


def sink(seed: int) -> Sink:
    rng = np.random.default_rng(seed)
    n, d = 8, 3
    mean_dir = np.array([1.0, 0.6, 0.4]) / np.linalg.norm([1.0, 0.6, 0.4])
    lengths = rng.uniform(0.6, 2.0, size=(n, 1))
    V = mean_dir * lengths + 0.55 * rng.normal(size=(n, d))
    V[0] = -0.3 * mean_dir  # the sink: a short vector, against the others ...
    # ... which receives the most attention
    alpha = np.r_[0.55, 0.45 * rng.dirichlet(np.ones(n - 1))]
    o, c, rel, cos = decompose(alpha, V)
    tau = kendalltau(alpha, c).statistic
    table = pd.DataFrame(
        {"attention α": alpha, "relative norm": rel, "cos": cos,
         "contribution c": c,
         "rank by α": (-alpha).argsort().argsort() + 1,
         "rank by c": (-c).argsort().argsort() + 1},
        index=[f"token {j + 1}" for j in range(n)])
    return Sink(alpha, V, o, c, rel, cos, tau, table)


def sink_reading(s: Sink) -> dict[str, str]:
    """What the sink's vector does to the output at this seed, as the prose's two phrases (plain words: the cosine
    and the weight stay in the page's own text): ``sink_direction`` and ``sink_effect``. Against the output
    (negative cosine and contribution, the case the example is drawn to show) or, at a seed where the noise
    turns it, with it."""
    if s.cos[0] < 0 and s.c[0] < 0:
        return {"sink_direction": "points against it", "sink_effect": "It does not build the output, it shrinks it."}
    return {"sink_direction": "at this seed points with it",
            "sink_effect": ("The noise added to every vector turned it: here the sink builds the output too (at seed 0 "
                            "it points against the output and shrinks it).")}


def random_heads(seed: int, n_trials: int, common_scale: float = 0.5) -> RandomHeads:
    """Random heads: value vectors share a weak common direction (``common_scale``) and have log-normal
    lengths; attention is Dirichlet(1). Seeded with ``seed + 1``."""
    from cwcore.core.inputs import check_count

    check_count(n_trials, "n_trials")  # 0 trials gave NaN shares and a numpy error in the sums' check
    rng = np.random.default_rng(seed + 1)
    n, d = 8, 16
    common = common_scale * rng.normal(size=(n_trials, 1, d))
    lengths = rng.lognormal(0, 0.5, size=(n_trials, n, 1))
    V = (common + rng.normal(size=(n_trials, n, d))) * lengths
    A = rng.dirichlet(np.ones(n), size=n_trials)
    O = np.einsum("tn,tnd->td", A, V)
    C = A * np.einsum("tnd,td->tn", V, O) / np.einsum("td,td->t", O, O)[:, None]
    taus = np.array([kendalltau(a_, c_).statistic for a_, c_ in zip(A, C)])
    return RandomHeads(A, C, taus)


def run(seed: int, n_trials: int) -> GeometryResult:
    """Every example of the chapter: the worked examples, the sink (seeded with ``seed``) and
    ``n_trials`` random heads (seeded with ``seed + 1``)."""
    shown = interference()
    return GeometryResult(sum_of_arrows(), shown, sweep(shown.V_des), sink(seed), random_heads(seed, n_trials))


# --- figures -------------------------------------------------------------------------------------------

def arrow(ax, start, vec, colour, lw=2.2, ls="-", label=None, alpha=1.0):
    start, vec = np.asarray(start, float), np.asarray(vec, float)
    ax.annotate("", xy=start + vec, xytext=start, arrowprops=dict(arrowstyle="-|>", color=colour, lw=lw, ls=ls,
                                                                  alpha=alpha, shrinkA=0, shrinkB=0, mutation_scale=16))
    if label:
        ax.plot([], [], color=colour, lw=lw, ls=ls, label=label)


def frame(ax, points, pad=0.25):
    # equal-aspect limits around the arrows' end points (arrows do not autoscale)
    pts = np.vstack([np.zeros(2), *points])
    lo, hi = pts.min(0) - pad, pts.max(0) + pad
    ax.set_xlim(lo[0], hi[0])
    ax.set_ylim(lo[1], hi[1])
    ax.set_aspect("equal")
    ax.axhline(0, color="0.8", lw=0.8, zorder=0)
    ax.axvline(0, color="0.8", lw=0.8, zorder=0)


def sum_of_arrows_figure(ex: Arrows):
    """(a) the value vectors, (b) weighted head to tail, (c) the contribution weights as projections."""
    alpha1, V1, o1, c1 = ex.alpha, ex.V, ex.o, ex.c
    fig = plt.figure(figsize=(9, 8))
    grid = fig.add_gridspec(2, 2, height_ratios=[1.1, 1])
    axes = [fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1]), fig.add_subplot(grid[1, :])]
    ax = axes[0]
    for j, v in enumerate(V1):
        arrow(ax, (0, 0), v, TOKEN[j], label=f"$v_{j + 1}$")
    arrow(ax, (0, 0), o1, OUTPUT, lw=2.8, label="$o$")
    frame(ax, list(V1) + [o1])
    ax.set_title("(a) value vectors")
    ax.legend(loc="upper left", fontsize=9)

    ax = axes[1]
    tip = np.zeros(2)
    for j, v in enumerate(V1):
        arrow(ax, tip, alpha1[j] * v, TOKEN[j], label=rf"$\alpha_{j + 1} v_{j + 1}$")
        tip = tip + alpha1[j] * v
    arrow(ax, (0, 0), o1, OUTPUT, lw=2.8, ls="--", label=r"$o=\sum_j \alpha_j v_j$")
    partial = np.cumsum(alpha1[:, None] * V1, axis=0)
    frame(ax, list(partial) + [o1], pad=0.15)
    ax.set_title("(b) weighted, head to tail")
    ax.legend(loc="upper left", fontsize=9)

    ax = axes[2]
    start = 0.0
    for j in range(3):
        ax.annotate(
            "",
            xy=(start + c1[j], j),
            xytext=(start, j),
            arrowprops=dict(
                arrowstyle="-|>",
                color=TOKEN[j],
                lw=2.5,
                shrinkA=0,
                shrinkB=0,
                mutation_scale=16,
            ),
        )
        ax.text(start + c1[j] / 2, j + 0.22, f"$c_{j + 1}$ = {c1[j]:+.2f}", ha="center", fontsize=10)
        ax.plot([start, start], [j - 1, j], color="0.6", lw=0.8, ls=":")
        start += c1[j]
    ax.annotate("", xy=(1, 3), xytext=(0, 3), arrowprops=dict(arrowstyle="-|>", color=OUTPUT, lw=2.8, shrinkA=0,
                                                              shrinkB=0))
    ax.text(0.5, 3.22, r"$o$: total = 1", ha="center", fontsize=10)
    for x in (0, 1):
        ax.axvline(x, color="0.75", lw=0.8, zorder=0)
    ax.set_yticks(range(4), ["token 1", "token 2", "token 3", "output"])
    ax.set_ylim(-0.6, 3.7)
    ax.set_xlabel(r"projection on $o$, in units of $\|o\|$")
    ax.set_title("(c) contribution weights")
    ax.grid(axis="y", visible=False)
    fig.tight_layout()
    return fig


def interference_figure(ex: Interference):
    """Constructive and destructive pairs: their arrows (top) and weights (bottom)."""
    alpha2 = ex.alpha
    fig, axes = plt.subplots(2, 2, figsize=(9, 7), gridspec_kw={"height_ratios": [1.3, 1]})
    for col, (V, o, c, name) in enumerate(
        [
            (ex.V_con, ex.o_con, ex.c_con, "constructive"),
            (ex.V_des, ex.o_des, ex.c_des, "destructive"),
        ]
    ):
        ax = axes[0, col]
        for j, v in enumerate(V):
            # v_j itself, faint
            arrow(ax, (0, 0), v, TOKEN[j], lw=1.2, ls=":", alpha=0.8)
        arrow(ax, (0, 0), alpha2[0] * V[0], TOKEN[0], label=r"$\alpha_1 v_1$")
        arrow(ax, alpha2[0] * V[0], alpha2[1] * V[1], TOKEN[1], label=r"$\alpha_2 v_2$")
        arrow(ax, (0, 0), o, OUTPUT, lw=3, label="$o$")
        frame(ax, list(V) + [o], pad=0.2)
        ax.set_title(f"{name}: ‖o‖ = {np.linalg.norm(o):.2f}")
        ax.legend(loc="lower right", fontsize=9)

        ax = axes[1, col]
        df = pd.DataFrame({"token": ["token 1", "token 2"] * 2, "weight": np.r_[alpha2, c],
                           "metric": ["attention α"] * 2 + ["contribution c"] * 2})
        sns.barplot(df, x="token", y="weight", hue="metric", palette=[ATTN, CONTRIB], ax=ax)
        ax.axhline(0, color="black", lw=0.8)
        ax.axhline(1, color="0.6", lw=0.8, ls=":")
        ax.set_xlabel("")
        ax.legend(fontsize=9, loc="best")
        for bar in ax.patches:
            h = bar.get_height()
            if np.isfinite(h) and bar.get_width() > 0:
                ax.text(bar.get_x() + bar.get_width() / 2, h, f"{h:.2f}", ha="center",
                        va="bottom" if h >= 0 else "top", fontsize=9)
    fig.tight_layout()
    return fig


def sweep_figure(ex: Sweep):
    """The output norm (top) and both contribution weights (bottom) against the attention on token 1."""
    fig, (ax0, ax1) = plt.subplots(2, 1, figsize=(8, 6.2), sharex=True)
    ax0.plot(ex.a, ex.norms, color=OUTPUT, lw=2)
    ax0.axvline(ex.a_star, color="0.5", ls="--", lw=1)
    ax0.set_ylabel(r"$\|o\|$")
    ax0.set_title("output norm and contribution weights as attention moves")
    ax1.plot(ex.a, ex.c[:, 0], color=TOKEN[0], lw=2, label="$c_1$")
    ax1.plot(ex.a, ex.c[:, 1], color=TOKEN[1], lw=2, label="$c_2$")
    ax1.plot(ex.a, ex.a, color=ATTN, lw=1.5, ls=":", label=r"$\alpha_1 = a$")
    ax1.axvline(ex.a_star, color="0.5", ls="--", lw=1)
    ax1.axhline(0, color="black", lw=0.8)
    ax1.set_xlabel(r"attention on token 1, $a$")
    ax1.set_ylabel("weight")
    ax1.legend(loc="upper left")
    fig.tight_layout()
    return fig


def sink_3d_figure(ex: Sink):
    """The sink example's value vectors and output in three dimensions."""
    V3, o3 = ex.V, ex.o
    fig = plt.figure(figsize=(7.5, 6.5))
    ax = fig.add_subplot(projection="3d")
    for j, v in enumerate(V3):
        ax.quiver(0, 0, 0, *v, color=TOKEN[j], lw=4 if j == 0 else 2, arrow_length_ratio=0.08)
        ax.text(*(v * 1.1), f"{j + 1}", color=TOKEN[j], fontsize=12, fontweight="bold")
    ax.quiver(0, 0, 0, *o3, color=OUTPUT, lw=4, arrow_length_ratio=0.2)
    ax.text(*(o3 * 1.35), "o", color=OUTPUT, fontsize=14, fontweight="bold")
    lo, hi = np.minimum(V3.min(0), 0) - 0.2, np.maximum(V3.max(0), 0) + 0.2
    ax.set_xlim(lo[0], hi[0])
    ax.set_ylim(lo[1], hi[1])
    ax.set_zlim(lo[2], hi[2])
    ax.set_box_aspect(None, zoom=0.95)
    ax.set_xlabel("x")
    ax.set_ylabel("y")
    ax.set_zlabel("z")
    ax.set_title("value vectors (token 1: the sink) and their weighted sum o")
    ax.view_init(elev=20, azim=-65)
    fig.tight_layout()
    return fig


def sink_weights_figure(ex: Sink):
    """The sink example's attention and contribution weights, per token."""
    n = len(ex.alpha)
    fig, ax = plt.subplots(figsize=(8, 4))
    df = pd.DataFrame({"token": [str(j + 1) for j in range(n)] * 2, "weight": np.r_[ex.alpha, ex.c],
                       "metric": ["attention α"] * n + ["contribution c"] * n})
    sns.barplot(df, x="token", y="weight", hue="metric", palette=[ATTN, CONTRIB], ax=ax)
    ax.axhline(0, color="black", lw=0.8)
    ax.set_title(f"both sum to 1, but rank differently: Kendall τ = {ex.tau:.2f}")
    ax.legend(title=None)
    fig.tight_layout()
    return fig


def random_heads_figure(ex: RandomHeads):
    """The per-head Kendall tau of the two rankings (left), and every token of the first 400 heads."""
    taus, A, C = ex.taus, ex.A, ex.C
    n_trials = len(A)
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(10, 4.2))
    sns.histplot(taus, bins=np.linspace(-1, 1, 30), color=CONTRIB, ax=ax0)
    ax0.axvline(np.median(taus), color="black", ls="--", lw=1, label=f"median {np.median(taus):.2f}")
    ax0.set_xlabel(r"Kendall $\tau$ of the rankings by $\alpha$ and by $c$")
    ax0.set_ylabel("heads")
    ax0.set_xticks([-1, -0.5, 0, 0.5, 1])
    ax0.legend()
    ax0.set_title("agreement of the two rankings, per head")
    sample = slice(0, min(n_trials, 400))
    ax1.scatter(A[sample].ravel(), C[sample].ravel(), s=6, alpha=0.35, color=ATTN, edgecolor="none")
    ax1.plot([0, 1], [0, 1], color="0.4", ls=":", lw=1, label=r"$c = \alpha$")
    ax1.axhline(0, color="black", lw=0.8)
    ax1.set_ylim(np.quantile(C, [0.002, 0.998]))
    ax1.set_xlabel(r"attention $\alpha_j$")
    ax1.set_ylabel(r"contribution $c_j$")
    ax1.legend(loc="upper left")
    ax1.set_title("every token of the first 400 heads")
    fig.tight_layout()
    return fig
