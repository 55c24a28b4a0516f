"""What a step costs: the step timer and the dense-span probe (`step_timer`, `bubbles`), the log lines
and summary (`step_report`), timelines (`bubble_plot`), kernel launches counted (`launches`), and
`freescale compare`'s trainings and reductions (`comparison`).
"""
