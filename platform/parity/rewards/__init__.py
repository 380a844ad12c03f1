"""Math-verify rewards. Import from the submodules (parity.rewards.grader, .extract): this package
stays empty so grading workers, which import it, do not pull in torch."""
